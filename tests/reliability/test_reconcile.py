"""The reconciler's lease path: a chunk whose worker vanished is re-published by `canvasq reconcile`
as soon as its lease has expired (no extra visibility timeout: a live worker renews its lease with
every heartbeat), and only once however many passes run before a worker claims it (every extra
message would be one more delivery against max_attempts). Workers run the pass themselves, one at
a time across the fleet (a lock in Redis)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

from sqlalchemy import select, update

from canvasq.core.settings import Settings
from canvasq.core.store import Store
from canvasq.core.tables import Chunk, utcnow
from canvasq.worker.celery_app import make_app
from canvasq.worker.reconcile import reconcile_loop
from tests.harness import probes
from tests.harness.scenario import write_input
from tests.harness.server import cli
from tests.harness.services import RedisServer
from tests.harness.workers import worker_env


def _fleet(tmp_path, redis: RedisServer, name: str):
    """A SQLite store for one test and `canvasq ARGS` against it and `redis` (its stdout)."""
    db = f"sqlite:///{tmp_path / name}"
    env = worker_env(
        db_url=db, broker_url=redis.url, soft_time_limit=1, hard_time_limit=2, visibility_timeout=3
    )
    return db, lambda *args: cli(env, *args).stdout


def _expire(store: Store, chunk_id: str) -> None:
    with store.Session.begin() as s:
        s.execute(
            update(Chunk).where(Chunk.id == chunk_id).values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )


def test_reconcile_republishes_an_expired_lease_once(tmp_path):
    with RedisServer(tmp_path) as redis:
        db, canvasq = _fleet(tmp_path, redis, "r.sqlite")
        canvasq("db", "upgrade")
        write_input(tmp_path / "in.jsonl", 4)
        run = (
            canvasq("submit", str(tmp_path / "in.jsonl"), "--queue", "q.rec", "--chunk-size", "2")
            .strip()
            .splitlines()[-1]
        )
        store = Store(db)
        try:
            assert redis.queue_length("q.rec") == 2
            c0, c1 = sorted(probes.chunk_attempts(store, run))
            # a worker took chunk 0 and died, and the message is gone from Redis
            claim = store.claim_chunk(c0, "ghost:1", 60, 3)
            assert claim.state == "work"
            client = redis.client()
            assert client.rpop("q.rec") is not None  # kombu consumes from the right: the oldest message
            client.close()
            assert redis.queue_length("q.rec") == 1
            assert "0 with expired leases" in canvasq("reconcile")  # lease still running
            assert store.heartbeat("ghost:1", c0, 60)  # the owner's heartbeat would keep it so
            _expire(store, c0)  # ... until its beats stop: the lease lapses
            first = canvasq("reconcile")
            second = canvasq("reconcile")
            assert "1 with expired leases" in first and "published 0 chunks" in second, (first, second)
            assert redis.queue_length("q.rec") == 2  # chunk 1's original + chunk 0 once
            assert not store.heartbeat("ghost:1", c0, 60)  # a late beat of the old owner renews nothing
            with store.Session() as s:
                st = dict(s.execute(select(Chunk.id, Chunk.status).where(Chunk.run_id == run)).all())
            assert st == {c0: "queued", c1: "queued"}
            again = store.claim_chunk(c0, "w:2", 60, 3)
            assert again.state == "work" and again.attempts == 2 and len(again.requests) == 2
            assert store.heartbeat("w:2", c0, 60) and not store.heartbeat("ghost:1", c0, 60)

            # a chunk whose rows are all finished is not re-published, even with a lapsed lease
            store.claim_chunk(c1, "ghost:2", 60, 3)
            from canvasq.core.queue import ResultRecord

            store.write_results(
                run, [ResultRecord(c, text="x") for c in probes.chunk_rows(store, c1)], "ghost:2"
            )
            _expire(store, c1)
            assert "0 with expired leases" in canvasq("reconcile")
        finally:
            store.dispose()


def test_workers_reconcile_loop_runs_one_pass_per_interval_across_the_fleet(tmp_path, monkeypatch):
    """Three workers' reconcile loops on one store and Redis: the lock lets one of them run each
    interval, an expired lease is re-published once, and a worker with another database is not
    held back by this fleet's lock."""
    with RedisServer(tmp_path) as redis:
        db = f"sqlite:///{tmp_path / 'l.sqlite'}"
        store = Store(db)
        store.upgrade()
        from canvasq.core.schemas import Job

        run = store.create_run(
            [Job(f"j{i}", "p", "math", 8, None, i + 1) for i in range(4)],
            model="m",
            queue="q.loop",
            chunk_size=2,
        )
        store.mark_published(run.chunk_ids)
        store.claim_chunk(run.chunk_ids[0], "dead:1", 60, 3)
        _expire(store, run.chunk_ids[0])
        settings = Settings(database_url=db, broker_url=redis.url, reconcile_s=1.0)
        passes: list[tuple[str, float]] = []
        published: list[str] = []

        def publish(ids, queue, _settings):
            published.extend(ids)
            return len(ids)

        import canvasq.worker.reconcile as rec

        real = rec.reconcile_once

        def counted(st, s, pub=None, grace=0.0):
            passes.append((threading.current_thread().name, time.monotonic()))
            return real(st, s, pub, grace)

        monkeypatch.setattr(rec, "reconcile_once", counted)
        stop = threading.Event()
        other = Settings(
            database_url=f"sqlite:///{tmp_path / 'other.sqlite'}", broker_url=redis.url, reconcile_s=1.0
        )
        other_store = Store(other.database_url)
        other_store.upgrade()
        threads = [
            threading.Thread(
                target=reconcile_loop, args=(store, settings, stop, f"w{i}", publish), name=f"w{i}"
            )
            for i in range(3)
        ]
        threads.append(
            threading.Thread(
                target=reconcile_loop, args=(other_store, other, stop, "x", publish), name="other"
            )
        )
        for th in threads:
            th.start()
        time.sleep(5.5)
        stop.set()
        for th in threads:
            th.join(10)
        other_store.dispose()
        ours = [at for name, at in passes if name != "other"]
        assert 3 <= len(ours) <= 6, passes  # about one per second, not three
        assert sum(name == "other" for name, _ in passes) >= 3, passes
        assert published == [run.chunk_ids[0]]
        store.dispose()


def test_reconcile_republishes_a_chunk_whose_message_the_broker_lost(tmp_path):
    """kombu pops a message before it records it as unacked: a worker killed between the two takes
    the message with it, and the chunk (never claimed, never unacked) would wait forever. A pass
    re-publishes such a chunk once; it leaves alone a chunk held unacked by a live worker, one still
    in the queue, and one published too recently to tell."""
    with RedisServer(tmp_path) as redis:
        db, canvasq = _fleet(tmp_path, redis, "lost.sqlite")
        canvasq("db", "upgrade")
        write_input(tmp_path / "in.jsonl", 6)
        run = canvasq("submit", str(tmp_path / "in.jsonl"), "--queue", "q.lost", "--chunk-size", "2").split()[
            -1
        ]
        store = Store(db)
        app = make_app(
            Settings(database_url=db, broker_url=redis.url, visibility_timeout=3), set_as_current=False
        )
        try:
            held, lost, waiting = sorted(probes.chunk_attempts(store, run))
            # a live worker holds the oldest chunk, unacked, until its connection closes
            with app.connection_for_read() as conn:
                msg = conn.default_channel.basic_get("q.lost", no_ack=False)
                assert msg is not None and msg.payload[0] == [held]
                client = redis.client()
                assert client.rpop("q.lost") is not None  # the next one: popped by a worker killed at once
                assert redis.queue_length("q.lost") == 1  # the youngest chunk still waits
                assert "0 lost by the broker" in canvasq(
                    "reconcile"
                )  # published a moment ago: not checked yet
                with store.Session.begin() as s:
                    s.execute(update(Chunk).values(published_at=utcnow() - timedelta(minutes=5)))
                first, second = canvasq("reconcile"), canvasq("reconcile")
                assert "1 lost by the broker" in first and "0 lost by the broker" in second, (first, second)
                queued = [json.loads(raw)["headers"]["argsrepr"] for raw in client.lrange("q.lost", 0, -1)]
                assert sorted(queued) == sorted([repr([lost]), repr([waiting])]), queued
                client.close()
        finally:
            store.dispose()
