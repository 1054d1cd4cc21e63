"""Leases and liveness in the store and the CLI (issue 19, part 5), on SQLite and PostgreSQL: the
heartbeat renews only the lease of the chunk its worker holds, `stuck_rows` finds exactly the rows
no live worker will finish, `canvasq workers` shows a worker without a heartbeat offline, and
`canvasq retry RUN --only stuck` re-queues those rows on the real Redis. Also: a SQLite store is
created readable by its owner only."""

from __future__ import annotations

import json
import os
import stat
from datetime import timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from canvasq.cli import cli
from canvasq.core.queue import ResultRecord
from canvasq.core.schemas import Job
from canvasq.core.store import Store
from canvasq.core.tables import Chunk, Worker, utcnow
from tests.harness.backends import queue_length


def jobs(n: int) -> list[Job]:
    return [Job(f"q{i}", f"prompt {i}", "math", 32, None, i + 1) for i in range(n)]


def _set(store: Store, model, key, **values) -> None:
    with store.Session.begin() as s:
        s.execute(update(model).where(model.id == key).values(**values))


def _lease(store: Store, chunk_id: str):
    with store.Session() as s:
        return s.get(Chunk, chunk_id).lease_expires_at


def test_heartbeat_renews_only_the_chunk_its_worker_holds(store):
    run = store.create_run(jobs(4), model="m", queue="q.t", chunk_size=2)
    c0, c1 = run.chunk_ids
    store.register_worker("h:1", "h", 1, "cpu", "m", "q.t")
    store.register_worker("h:2", "h", 2, "cpu", "m", "q.t")
    store.claim_chunk(c0, "h:1", 60, 3)
    store.claim_chunk(c1, "h:2", 60, 3)
    _set(store, Chunk, c0, lease_expires_at=utcnow() + timedelta(seconds=5))
    first = _lease(store, c0)
    assert store.heartbeat("h:1", c0, 60)
    renewed = _lease(store, c0)
    assert renewed > first + timedelta(seconds=50)
    assert not store.heartbeat("h:1", c1, 60)  # another worker's chunk: not renewed
    assert not store.heartbeat("h:1", None, 60)  # between chunks: only the worker's own row
    store.finish_chunk(c0)
    assert not store.heartbeat("h:1", c0, 60)  # a finished chunk is no one's to renew
    assert _lease(store, c0) == renewed


def test_stuck_rows_are_the_ones_no_live_worker_will_finish(store):
    run = store.create_run(jobs(12), model="m", queue="q.t", chunk_size=2)
    c = run.chunk_ids  # 6 chunks: q0-q1, q2-q3, ...
    store.mark_published(c[:5])  # c[5] never published (a crash between commit and publish)
    now = utcnow()
    store.register_worker("live", "h", 1, "cpu", "m", "q.t")
    store.register_worker("dead", "h", 2, "cpu", "m", "q.t")
    _set(store, Worker, "dead", heartbeat_at=now - timedelta(seconds=300))
    store.claim_chunk(c[0], "live", 60, 3)  # held by a live worker under a live lease
    store.claim_chunk(c[1], "dead", 60, 3)  # lease still running, but its worker stopped beating
    store.claim_chunk(c[2], "live", 60, 3)  # a live worker's lapsed lease (it lost the chunk)
    _set(store, Chunk, c[2], lease_expires_at=now - timedelta(seconds=1))
    store.claim_chunk(c[3], "live", 60, 3)  # ended with a row left queued
    store.write_results(run.run_id, [ResultRecord("q6", text="x")], "live")
    store.finish_chunk(c[3])
    # c[4]: published and waiting in the queue: not stuck
    offline_before = now - timedelta(seconds=55)
    assert store.stuck_rows(run.run_id, offline_before) == ["q2", "q3", "q4", "q5", "q7", "q10", "q11"]

    new = store.retry_run(run.run_id, ["stuck"], 16, offline_before=offline_before)
    assert len(new) == 1 and store.unpublished_chunks(run.run_id)[0][0] == new[0]
    assert store.stuck_rows(run.run_id, offline_before) == [
        "q2",
        "q3",
        "q4",
        "q5",
        "q7",
        "q10",
        "q11",
    ]  # unpublished
    store.mark_published(new)
    assert store.stuck_rows(run.run_id, offline_before) == []
    assert store.counts(run.run_id)["queued"] == 11 and store.run_status(run.run_id) == "running"
    # the dead worker's old chunk lost its rows: reconcile has nothing to re-publish there
    _set(store, Chunk, c[1], lease_expires_at=now - timedelta(seconds=1))
    assert c[1] not in {cid for cid, _ in store.stale_chunks()}


def test_worker_stats_online_offline_and_the_chunk_held(store):
    run = store.create_run(jobs(2), model="m", queue="q.t", chunk_size=2)
    store.register_worker("a", "h", 1, "cpu", "m", "q.t")
    store.register_worker("b", "h", 2, "cpu", "m", "q.t")
    store.claim_chunk(run.chunk_ids[0], "a", 60, 3)
    _set(store, Worker, "b", heartbeat_at=utcnow() - timedelta(seconds=120))
    rows = {r["worker"]: r for r in store.worker_stats(55)}
    assert rows["a"]["online"] and rows["a"]["chunk"] == run.chunk_ids[0]
    assert not rows["b"]["online"] and rows["b"]["chunk"] is None and rows["b"]["last_seen_s"] >= 119


@pytest.fixture
def cli_env(service_env):
    store = Store(service_env["url"])
    store.upgrade()
    yield service_env | {"store": store}
    store.dispose()


def _invoke(*args):
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


def test_workers_command_shows_a_silent_worker_offline(cli_env):
    store = cli_env["store"]
    store.register_worker("host:11", "host", 11, "cpu", "models/testbed", cli_env["queue"])
    store.register_worker("host:22", "host", 22, "0", "models/testbed", cli_env["queue"])
    _set(store, Worker, "host:22", heartbeat_at=utcnow() - timedelta(seconds=56))  # 3 × 15 + 10 s: gone
    rows = json.loads(_invoke("workers", "--json"))
    assert [(r["worker"], r["online"]) for r in rows] == [("host:11", True), ("host:22", False)]
    table = _invoke("workers").splitlines()
    assert "state" in table[0] and "chunk" in table[0]
    assert "online" in next(x for x in table if "host:11" in x)
    assert "offline" in next(x for x in table if "host:22" in x)


def test_retry_only_stuck_requeues_a_dead_workers_rows(cli_env):
    store, q = cli_env["store"], cli_env["queue"]
    run = store.create_run(jobs(6), model="m", queue=q, chunk_size=2)
    store.mark_published(run.chunk_ids)
    store.register_worker("dead:1", "h", 1, "cpu", "m", q)
    store.register_worker("live:2", "h", 2, "cpu", "m", q)
    store.claim_chunk(run.chunk_ids[0], "dead:1", 60, 3)
    store.claim_chunk(run.chunk_ids[1], "live:2", 60, 3)
    store.write_results(run.run_id, [ResultRecord("q0", text="x")], "dead:1")
    nothing = _invoke("retry", run.run_id, "--only", "stuck")  # both workers still beat
    assert "no rows in ['stuck']" in nothing and "5 queued rows are held by live workers" in nothing
    assert queue_length(q) == 0
    _set(store, Worker, "dead:1", heartbeat_at=utcnow() - timedelta(seconds=120))
    out = _invoke("retry", run.run_id, "--only", "stuck")
    assert "re-queued 1 rows in 1 chunks" in out, out
    assert queue_length(q) == 1  # one message, for q1 only: q0 is done, chunks 1-2 are alive / waiting
    assert store.stuck_rows(run.run_id, utcnow() - timedelta(seconds=55)) == []
    bad = CliRunner().invoke(cli, ["retry", run.run_id, "--only", "queued"])
    assert bad.exit_code != 0 and "stuck" in bad.output


def test_sqlite_store_is_created_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "s.sqlite"
        st = Store(f"sqlite:///{path}")
        st.upgrade()
        st.register_worker("w", "h", 1, "cpu", "m", None)
        with st.engine.connect():  # WAL and shared-memory files exist while a connection is open
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("s.sqlite*")}
        st.dispose()
    finally:
        os.umask(old)
    assert {"s.sqlite", "s.sqlite-wal", "s.sqlite-shm"} <= set(modes), modes
    assert set(modes.values()) == {0o600}, modes
    existing = tmp_path / "mine.sqlite"
    existing.touch(mode=0o640)
    os.chmod(existing, 0o640)
    Store(f"sqlite:///{existing}").dispose()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640  # a file the user made is left as it is
