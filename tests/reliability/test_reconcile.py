"""The reconciler's lease path: a chunk whose worker vanished and whose message Redis no longer
holds is re-published by `canvasq reconcile` once its lease (plus one visibility timeout, Redis's
own chance to restore it) has expired, and only once however many passes run before a worker
claims it (every extra message would be one more delivery against max_attempts)."""

from __future__ import annotations

import subprocess
import sys
import time

from canvasq.api.store import Store
from canvasq.testing import probes
from canvasq.testing.scenario import write_input
from canvasq.testing.services import RedisServer
from canvasq.testing.workers import worker_env


def test_reconcile_republishes_an_expired_lease_once(tmp_path):
    with RedisServer(tmp_path) as redis:
        db = f"sqlite:///{tmp_path / 'r.sqlite'}"
        env = worker_env(
            db_url=db, broker_url=redis.url, soft_time_limit=1, hard_time_limit=2, visibility_timeout=3
        )

        def cli(*args):
            res = subprocess.run(
                [sys.executable, "-m", "canvasq.api.cli", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
            )
            assert res.returncode == 0, res.stdout + res.stderr
            return res.stdout

        cli("db", "upgrade")
        write_input(tmp_path / "in.jsonl", 4)
        run = (
            cli("submit", str(tmp_path / "in.jsonl"), "--queue", "q.rec", "--chunk-size", "2")
            .strip()
            .splitlines()[-1]
        )
        store = Store(db)
        try:
            assert redis.queue_length("q.rec") == 2
            c0, c1 = sorted(probes.chunk_attempts(store, run))
            # a worker took chunk 0 and died, and the message is gone from Redis
            claim = store.claim_chunk(c0, "ghost:1", 1, 3)
            assert claim.state == "work"
            client = redis.client()
            assert client.rpop("q.rec") is not None  # kombu consumes from the right: the oldest message
            client.close()
            assert redis.queue_length("q.rec") == 1
            assert "0 with expired leases" in cli("reconcile")  # lease not yet past the grace period
            time.sleep(1 + 3 + 1)  # lease 1 s, one visibility timeout, a margin
            first = cli("reconcile")
            second = cli("reconcile")
            assert "1 with expired leases" in first and "published 0 chunks" in second, (first, second)
            assert redis.queue_length("q.rec") == 2  # chunk 1's original + chunk 0 once
            with store.Session() as s:
                from sqlalchemy import select

                from canvasq.api.models import Chunk

                st = dict(s.execute(select(Chunk.id, Chunk.status).where(Chunk.run_id == run)).all())
            assert st == {c0: "queued", c1: "queued"}
            again = store.claim_chunk(c0, "w:2", 60, 3)
            assert again.state == "work" and again.attempts == 2 and len(again.requests) == 2
        finally:
            store.dispose()
