"""The store on SQLite and PostgreSQL: idempotent writes, counts from rows, the attempts cap,
cancel / expire / retry state changes, and SQLite connection pragmas."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import event, func, select, text, update

from canvasq.core.queue import ResultRecord
from canvasq.core.schemas import Job
from canvasq.core.store import Store
from canvasq.core.tables import Chunk, Output, Request, utcnow


def jobs(n: int, prefix: str = "q") -> list[Job]:
    return [Job(f"{prefix}{i}", f"prompt {i}", "math", 32, None, i + 1) for i in range(n)]


def make_run(store: Store, n: int = 10, chunk_size: int = 4, **kw):
    return store.create_run(jobs(n), model="models/testbed", queue="q.test", chunk_size=chunk_size, **kw)


def done(cid: str, tokens: int = 5, decoder: str = "official", **kw) -> ResultRecord:
    traces = [
        {
            "forward_index": i,
            "rows": 32,
            "commits": 2,
            "canvases": 1,
            "states": "full",
            "ms": 1.5,
            "kind": "decode",
        }
        for i in range(3)
    ]
    return ResultRecord(
        cid,
        text=f"answer {cid}",
        token_ids=list(range(tokens)),
        finish_reason="stop",
        prompt_tokens=7,
        completion_tokens=tokens,
        forwards=3,
        decoder=decoder,
        gen_ms=100.0,
        traces=traces,
        **kw,
    )


def test_create_run_chunks_and_counts(store):
    created = make_run(store, 10, 4)
    assert created.created and created.requests == 10 and len(created.chunk_ids) == 3
    c = store.counts(created.run_id)
    assert c["total"] == 10 and c["queued"] == 10 and c["done"] == 0


def test_create_run_inserts_chunks_in_bulk(store):
    """One INSERT per table per streamed batch, not one per chunk; requests still point at their chunk."""
    statements: list[str] = []

    def seen(conn, cursor, statement, params, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO"):
            statements.append(statement.split()[2].strip('"'))

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        big = make_run(store, 40, 4)  # 10 chunks, one batch of requests
        small = store.create_run(jobs(10, "s"), model="m", queue="q", chunk_size=4, batch_rows=3)
    finally:
        event.remove(store.engine, "before_cursor_execute", seen)
    assert len(big.chunk_ids) == 10 and len(small.chunk_ids) == 3
    # big: the run, its chunks, its requests; small: the run, then chunks + requests for each of
    # four batches of ≤ 3 rows (a batch starting inside a chunk opened by the previous one adds none)
    assert statements[:3] == ["runs", "chunks", "requests"]
    assert statements[3:] == [
        "runs",
        "chunks",
        "requests",
        "chunks",
        "requests",
        "chunks",
        "requests",
        "requests",
    ]
    with store.Session() as s:
        for run in (big, small):
            got = s.execute(
                select(Request.chunk_id, func.count())
                .where(Request.run_id == run.run_id)
                .group_by(Request.chunk_id)
                .order_by(Request.chunk_id)
            ).all()
            sizes = [4] * (run.requests // 4) + ([run.requests % 4] if run.requests % 4 else [])
            assert got == list(zip(run.chunk_ids, sizes))


def test_idempotency_key_returns_same_run(store):
    a = make_run(store, 5, idempotency_key="nightly-1")
    b = make_run(store, 5, idempotency_key="nightly-1")
    assert (b.run_id, b.created, b.chunk_ids) == (a.run_id, False, a.chunk_ids)
    assert len(store.list_runs()) == 1


def test_duplicate_results_write_once(store):
    """A redelivered chunk (same results again) writes nothing new: one output per custom_id."""
    run = make_run(store, 4, 4)
    assert store.write_results(run.run_id, [done("q0"), done("q1")], "w1") == 2
    assert store.write_results(run.run_id, [done("q0", tokens=9), done("q1")], "w2") == 0
    with store.Session() as s:
        rows = s.execute(
            select(Output.custom_id, Output.completion_tokens, Output.worker_id)
            .where(Output.run_id == run.run_id)
            .order_by(Output.custom_id)
        ).all()
        n_traces = s.scalar(text("select count(*) from forward_traces where run_id = :r"), {"r": run.run_id})
    assert rows == [("q0", 5, "w1"), ("q1", 5, "w1")]
    assert n_traces == 6
    assert store.counts(run.run_id)["done"] == 2


def test_claim_skips_done_rows_and_caps_attempts(store):
    run = make_run(store, 4, 4)
    cid = run.chunk_ids[0]
    first = store.claim_chunk(cid, "w1", 60, max_attempts=2)
    assert first.state == "work" and len(first.requests) == 4 and first.attempts == 1
    store.write_results(run.run_id, [done("q0")], "w1")
    second = store.claim_chunk(cid, "w2", 60, max_attempts=2)  # redelivery after a crash
    assert second.state == "work" and [r.custom_id for r in second.requests] == ["q1", "q2", "q3"]
    third = store.claim_chunk(cid, "w3", 60, max_attempts=2)  # past the cap
    assert third.state == "exhausted"
    c = store.counts(run.run_id)
    assert c["done"] == 1 and c["errored"] == 3 and c["queued"] == 0
    assert store.finalize_run(run.run_id) == "completed"
    with store.Session() as s:
        codes = s.scalars(
            select(Output.error_code).where(Output.run_id == run.run_id, Output.error_code.is_not(None))
        )
        assert set(codes) == {"worker_lost"}


def test_duplicates_of_a_finished_chunk_are_not_counted(store):
    """Duplicate deliveries of a finished chunk (an outbox race, a broker redelivery) find nothing to
    do: no attempt counted, the chunk stays done however many arrive (counted, a cap of 2 would have
    turned it failed). A chunk that ended with a row left queued is still a delivery."""
    run = make_run(store, 4, 2)
    cid = run.chunk_ids[0]
    assert store.claim_chunk(cid, "w1", 60, max_attempts=2).state == "work"
    store.write_results(run.run_id, [done("q0"), done("q1")], "w1")
    store.finish_chunk(cid)
    for worker in ("w2", "w3", "w4"):
        dup = store.claim_chunk(cid, worker, 60, max_attempts=2)
        assert dup.state == "empty" and dup.attempts == 1 and not dup.requests
    with store.Session() as s:
        chunk = s.get(Chunk, cid)
        assert (chunk.status, chunk.attempts, chunk.worker_id) == ("done", 1, "w1")
    other = run.chunk_ids[1]
    assert store.claim_chunk(other, "w1", 60, max_attempts=2).state == "work"
    store.write_results(run.run_id, [done("q2")], "w1")
    store.finish_chunk(other)  # q3 left queued
    again = store.claim_chunk(other, "w2", 60, max_attempts=2)
    assert again.state == "work" and again.attempts == 2 and [r.custom_id for r in again.requests] == ["q3"]


def test_summary_counts_come_from_rows(store):
    run = make_run(store, 6, 3)
    store.claim_chunk(run.chunk_ids[0], "w1", 60, 3)
    store.write_results(
        run.run_id,
        [
            done("q0", 10),
            done("q1", 20, decoder="funnel"),
            ResultRecord("q2", status="errored", error_code="decode_error", error_message="boom"),
        ],
        "w1",
    )
    s = store.run_summary(run.run_id)
    assert s["counts"] == {"queued": 3, "done": 2, "errored": 1, "expired": 0, "cancelled": 0, "total": 6}
    assert s["completion_tokens"] == 30 and s["forwards"] == 6
    assert s["prompt_tokens"] == 14 and s["gen_s"] == pytest.approx(0.2)  # the errored row counts nowhere
    assert [(d["decoder"], d["requests"], d["tokens"], d["forwards"]) for d in s["decoders"]] == [
        ("funnel", 1, 20, 3),
        ("official", 1, 10, 3),
    ]
    assert s["decoders"][0]["tok_s"] == pytest.approx(200.0)  # 20 tokens in 100 ms
    assert s["status"] == "running"
    listed = store.list_runs()[0]
    assert (listed["total"], listed["done"], listed["errored"], listed["queued"]) == (6, 2, 1, 3)
    with store.Session() as sess:  # the migration's view agrees with the ORM query
        view = dict(
            sess.execute(
                text("select decoder, tokens from run_throughput where run_id = :r"), {"r": run.run_id}
            ).all()
        )
    assert view == {"official": 10, "funnel": 20}


def test_cancel_keeps_finished_rows(store):
    run = make_run(store, 8, 4)
    store.claim_chunk(run.chunk_ids[0], "w1", 60, 3)  # chunk 0 running, chunk 1 not started
    store.write_results(run.run_id, [done("q0")], "w1")
    assert store.cancel_run(run.run_id) == "cancelling"  # chunk 0's rows still queued on a worker
    c = store.counts(run.run_id)
    assert c["done"] == 1 and c["cancelled"] == 4 and c["queued"] == 3
    assert store.claim_chunk(run.chunk_ids[1], "w2", 60, 3).state == "cancelled"
    store.close_chunk_rows(run.chunk_ids[0], run.run_id, "cancelled", "cancelled", "run cancelled")
    assert store.finalize_run(run.run_id) == "cancelled"
    assert store.counts(run.run_id)["done"] == 1


def test_expire_and_retry(store):
    run = make_run(store, 6, 3, deadline_s=60)
    store.claim_chunk(run.chunk_ids[0], "w1", 60, 3)
    store.write_results(run.run_id, [done("q0"), ResultRecord("q1", status="errored", error_code="x")], "w1")
    assert store.expire_overdue(utcnow() + timedelta(seconds=120)) == [run.run_id]
    c = store.counts(run.run_id)
    assert (c["done"], c["errored"], c["expired"], c["queued"]) == (1, 1, 4, 0)
    assert store.run_status(run.run_id) == "expired"
    new_chunks = store.retry_run(run.run_id, ["errored"], chunk_size=10)
    assert len(new_chunks) == 1 and store.counts(run.run_id)["queued"] == 1
    claim = store.claim_chunk(new_chunks[0], "w2", 60, 3)
    assert [r.custom_id for r in claim.requests] == ["q1"]
    assert store.write_results(run.run_id, [done("q1")], "w2") == 1  # overwrites the errored output
    with store.Session() as s:
        assert (
            s.scalar(select(Output.error_code).where(Output.run_id == run.run_id, Output.custom_id == "q1"))
            is None
        )
        assert s.scalar(select(func.count()).select_from(Output).where(Output.run_id == run.run_id)) == 6


def _lock_wait_seen(store: Store, timeout_s: float) -> bool:
    """Whether a session of this database waits on a lock within `timeout_s`. Each poll is its own
    transaction (autocommit): inside one, PostgreSQL keeps serving the first read of pg_stat_activity."""
    waiting = text(
        "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and datname = current_database()"
    )
    deadline = time.monotonic() + timeout_s
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as watch:
        while time.monotonic() < deadline:
            if watch.execute(waiting).scalar():
                return True
            time.sleep(0.05)
    return False


def test_expiry_keeps_the_output_of_a_row_a_worker_stores_meanwhile(store):
    """A worker stores q0 (status and output, not yet committed) while the deadline pass runs: the pass
    waits on q0's row, then must leave it to the worker. A pass that read the queued rows first and
    then wrote an `expired` output line for each would give q0 one too: a `done` row with an error."""
    if store.dialect != "postgresql":
        pytest.skip("SQLite serialises writers: the two transactions cannot interleave")
    run = make_run(store, 4, 4, deadline_s=60)
    store.claim_chunk(run.chunk_ids[0], "w1", 60, 3)
    got: list = []
    with store.Session.begin() as worker:
        assert store._write_batch(worker, run.run_id, [done("q0")], "w1", utcnow()) == 1
        expire = threading.Thread(
            target=lambda: got.append(store.expire_overdue(utcnow() + timedelta(seconds=120)))
        )
        expire.start()
        assert _lock_wait_seen(store, 30), "the deadline pass never waited on the worker's row"
    expire.join(30)
    assert got == [[run.run_id]]
    with store.Session() as s:
        out = dict(
            s.execute(select(Output.custom_id, Output.error_code).where(Output.run_id == run.run_id)).all()
        )
        status = dict(
            s.execute(select(Request.custom_id, Request.status).where(Request.run_id == run.run_id)).all()
        )
    assert status == {"q0": "done", "q1": "expired", "q2": "expired", "q3": "expired"}
    assert out == {"q0": None, "q1": "expired", "q2": "expired", "q3": "expired"}


def test_stale_and_unpublished_chunks(store):
    run = make_run(store, 4, 2)
    assert {c for c, _ in store.unpublished_chunks()} == set(run.chunk_ids)
    store.mark_published(run.chunk_ids)
    assert store.unpublished_chunks() == []
    store.claim_chunk(run.chunk_ids[0], "w1", lease_s=1, max_attempts=3)
    assert store.stale_chunks(utcnow() + timedelta(seconds=5)) == [(run.chunk_ids[0], "q.test")]
    assert store.stale_chunks(utcnow()) == []


def test_workers_register_and_throughput(store):
    run = make_run(store, 2, 2)
    store.register_worker("h:1", "h", 1, "0", "models/testbed", "q.test")
    store.register_worker("h:1", "h", 1, "0", "models/testbed", "q.test")  # upsert, not a second row
    store.write_results(run.run_id, [done("q0", 10), done("q1", 30)], "h:1")
    stats = store.worker_stats()
    assert len(stats) == 1 and stats[0]["requests"] == 2 and stats[0]["tokens"] == 40
    assert stats[0]["tok_s"] == pytest.approx(40 / 0.2)


def test_sqlite_pragmas_on_every_connection(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'p.sqlite'}", busy_timeout_ms=1234)
    for _ in range(2):
        with st.engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert raw.execute("PRAGMA foreign_keys").fetchone()[0] == 1
            assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
        st.engine.dispose()  # next round gets a brand-new connection


def test_foreign_keys_enforced(store):
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), store.Session.begin() as s:
        s.add(
            Request(run_id="run_missing", custom_id="x", line_no=1, prompt="p", max_tokens=1, status="queued")
        )


def _writer(url: str, run_id: str, ids: list[str], q) -> None:
    st = Store(url)
    n = 0
    for cid in ids:
        n += st.write_results(run_id, [done(cid)], f"p{cid}")
    q.put(n)


def test_concurrent_sqlite_writers_do_not_lock(tmp_path):
    """Four processes write one SQLite file at once: every row lands, no "database is locked"."""
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    st = Store(url)
    st.upgrade()
    run = st.create_run(jobs(200), model="m", queue="q", chunk_size=50)
    ids = [f"q{i}" for i in range(200)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(url, run.run_id, ids[i::4] + ids[(i + 1) % 4 :: 4], q))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert sum(q.get() for _ in procs) == 200  # each id offered twice, written once
    assert st.counts(run.run_id)["done"] == 200


def test_embedded_interrupt_resume_and_orphan_cancel(store):
    """Issue 19 part 4 on both dialects: a clean stop releases the running chunk without counting the
    delivery; pending_chunks lists chunks still holding queued rows; a cancel of a run no process
    holds closes the running chunk's rows too, so nothing stays queued."""
    rows = [Job(f"r{i}", "p", "math", 8, None, i + 1) for i in range(5)]
    created = store.create_run(
        rows,
        model="m",
        queue="embedded",
        decoder="funnel",
        chunk_size=2,
        mode="embedded",
        idempotency_key="embedded:k",
    )
    rid = created.run_id
    assert store.run_by_key("embedded:k") == rid and store.pending_chunks(rid) == created.chunk_ids
    store.claim_chunk(created.chunk_ids[0], "w", 60, 3)
    store.write_results(rid, [ResultRecord("r0", text="x")])
    store.mark_interrupted(rid, release_chunks=True)
    assert store.run_status(rid) == "interrupted"
    with store.Session() as s:
        first = s.get(Chunk, created.chunk_ids[0])
        assert (first.status, first.attempts) == ("queued", 0)
    assert store.pending_chunks(rid) == created.chunk_ids  # r1 still queued in chunk 0
    store.resume_run(rid)
    assert store.run_status(rid) == "running"
    store.claim_chunk(created.chunk_ids[1], "w", 60, 3)  # a chunk a dead process held
    store.mark_interrupted(rid)
    assert store.cancel_run(rid, close_running=True) == "cancelled"
    c = store.counts(rid)
    assert (c["done"], c["cancelled"], c["queued"]) == (1, 4, 0)
    again = store.create_run(
        rows, model="m", queue="embedded", chunk_size=2, idempotency_key="embedded:k", replace_key=True
    )
    assert (
        again.created
        and store.run_by_key("embedded:k") == again.run_id
        and store.get_run(rid).idempotency_key is None
    )


def test_a_periodic_reconcile_leaves_a_submit_publishing_alone(store):
    """The outbox race (every chunk of a run delivered twice, each counted toward max_attempts): a
    worker's periodic pass that runs between a submit storing its chunks and marking them published
    must not publish them too. Periodic passes skip outbox rows younger than OUTBOX_GRACE_S; a pass by hand (grace 0)
    and a periodic pass once the rows are older publish each chunk once."""
    from canvasq.core.settings import Settings
    from canvasq.worker.reconcile import OUTBOX_GRACE_S, reconcile_once

    jobs = [Job(f"c{i}", "p", "math", 32, None, i + 1) for i in range(4)]
    run = store.create_run(jobs, model="m", queue="q", chunk_size=2)
    sent: list[str] = []

    def publish(ids, queue, settings):
        sent.extend(ids)
        return len(ids)

    settings = Settings(database_url="sqlite://")
    assert reconcile_once(store, settings, publish, OUTBOX_GRACE_S).published == 0 and sent == []
    with store.Session.begin() as s:  # the submit crashed a grace period ago without publishing
        s.execute(
            update(Chunk)
            .where(Chunk.run_id == run.run_id)
            .values(updated_at=utcnow() - timedelta(seconds=OUTBOX_GRACE_S + 1))
        )
    assert reconcile_once(store, settings, publish, OUTBOX_GRACE_S).published == 2
    assert sorted(sent) == sorted(run.chunk_ids)
    assert reconcile_once(store, settings, publish).published == 0 and len(sent) == 2


def test_claim_ahead_and_the_late_message(store):
    """A chunk claimed ahead (a counted delivery) makes its own message a no-op while the claim holds
    (busy) and once done (empty); after its lease lapses a delivery claims it as usual. Outbox rows
    (never published) are not taken ahead; a released chunk is queued again, its claim uncounted."""
    run = make_run(store, 6, 2)
    assert store.claim_ahead(run.run_id, "w1", 60, 3) is None  # nothing published yet
    store.mark_published(run.chunk_ids)
    first = store.claim_ahead(run.run_id, "w1", 60, 3)
    assert (first.state, first.chunk_id, first.attempts) == ("work", run.chunk_ids[0], 1)
    assert [r.custom_id for r in first.requests] == ["q0", "q1"]
    late = store.claim_chunk(run.chunk_ids[0], "w2", 60, 3)
    assert late.state == "busy" and late.attempts == 1 and not late.requests
    assert store.heartbeat("w1", [run.chunk_ids[0]], 60)  # renewed by its holder
    store.write_results(run.run_id, [done("q0"), done("q1")], "w1")
    store.finish_chunk(run.chunk_ids[0])
    assert store.claim_chunk(run.chunk_ids[0], "w2", 60, 3).state == "empty"
    second = store.claim_ahead(run.run_id, "w1", 60, 3)
    assert second.chunk_id == run.chunk_ids[1]
    store.release_ahead(second.chunk_id, "w1")
    with store.Session() as s:
        c1 = s.get(Chunk, run.chunk_ids[1])
        assert (c1.status, c1.attempts, c1.claimed_ahead, c1.worker_id) == ("queued", 0, False, None)
    again = store.claim_ahead(run.run_id, "w1", 60, 3)
    assert again.chunk_id == run.chunk_ids[1]
    with store.Session.begin() as s:  # its holder died: the lease lapsed
        s.execute(
            update(Chunk)
            .where(Chunk.id == again.chunk_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
    taken = store.claim_chunk(again.chunk_id, "w2", 60, 3)
    assert (taken.state, taken.attempts, [r.custom_id for r in taken.requests]) == ("work", 2, ["q2", "q3"])
    with store.Session() as s:
        assert s.get(Chunk, again.chunk_id).claimed_ahead is False
