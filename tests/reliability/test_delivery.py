"""Delivery semantics (RELIABILITY.md T5, T6, T7, T8/T9, T12, T13, T14, T15) and secrets masked in
logs and CLI output. Each scenario ends with the exactly-once check."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

from sqlalchemy import func, select, update

from canvasq.core.settings import Settings
from canvasq.core.tables import Chunk, Run, utcnow
from tests.harness import probes
from tests.harness.waiting import wait_for


def test_t14_idempotent_submit_t6_refusing_worker_t5_duplicate_delivery(scenario):
    """T14: the same file and key submitted twice → one run id, one set of chunks and messages.
    T6: a worker whose visibility timeout is below its hard limit refuses to start, through the
    canvasq CLI and through plain `celery worker`, and consumes nothing.
    T5: every chunk delivered again after its rows were stored → nothing new is written."""
    with scenario(db="postgresql") as sc:
        ids = sc.write_input(8)
        run = sc.submit("--chunk-size", "4", "--key", "nightly-1")
        again = sc.submit("--chunk-size", "4", "--key", "nightly-1")
        assert again == run
        with sc.store.Session() as s:
            assert s.scalar(select(func.count()).select_from(Run)) == 1
            chunk_ids = list(s.scalars(select(Chunk.id).where(Chunk.run_id == run).order_by(Chunk.id)))
        assert len(chunk_ids) == 2 and sc.redis.queue_length(sc.queue) == 2

        bad = {"visibility_timeout": 20, "hard_time_limit": 30, "soft_time_limit": 25}
        refused = sc.worker(**bad)
        assert refused.wait_exit(120) != 0
        assert "visibility_timeout > hard_time_limit > soft_time_limit" in refused.log()
        plain = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "canvasq.worker.celery_app:app",
                "worker",
                "-Q",
                sc.queue,
                "-c",
                "1",
                "--without-gossip",
                "--without-mingle",
            ],
            env=sc.env(**bad),
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=sc.tmp,
        )
        assert plain.returncode != 0, plain.stdout[-2000:] + plain.stderr[-2000:]
        assert "refusing to start" in plain.stdout + plain.stderr
        assert sc.redis.queue_length(sc.queue) == 2 and probes.unacked(sc.redis.client()) == 0
        assert set(probes.chunk_attempts(sc.store, run).values()) == {0}

        w = sc.worker()
        w.wait_ready()
        sc.wait_terminal(run)
        sc.check(run, ids, run_status="completed", statuses={"done": 8})
        before = probes.outputs_snapshot(sc.store, run)

        from canvasq.worker.celery_app import publish_chunks

        publish_chunks(chunk_ids, sc.queue, Settings(broker_url=sc.redis.url, database_url=sc.db_url))
        wait_for(
            lambda: sc.redis.queue_length(sc.queue) == 0 and probes.unacked(sc.redis.client()) == 0,
            "both duplicates consumed",
            120,
            diagnose=sc.logs,
        )
        wait_for(
            lambda: w.log().count("'state': 'empty'") == 2,
            "both duplicates found nothing to do",
            60,
            diagnose=sc.logs,
        )
        assert probes.outputs_snapshot(sc.store, run) == before
        assert set(probes.chunk_attempts(sc.store, run).values()) == {1}  # duplicates are not deliveries
        sc.check(run, ids, run_status="completed", statuses={"done": 8})


def test_t7_poison_chunk_is_dead_lettered_after_max_attempts(scenario):
    """T7: a chunk that crashes every worker process it reaches is delivered at most N times; its
    unfinished rows become errored/worker_lost, rows done before the crash stay, the run ends and
    the worker keeps serving. Under continuous batching (2 slots) the poison row is fed as soon as a
    slot frees, so the one row in flight beside it (ids[4] or ids[5]) dies with it, and ids[7] is
    never reached: three rows of chunk 1 end worker_lost."""
    with scenario(db="postgresql", max_attempts=2) as sc:
        ids = sc.write_input(12)
        poison = ids[6]  # second chunk: fed once one of ids[4:6] has finished
        w = sc.worker(extra={"CANVASQ_TEST_POISON": poison})
        w.wait_ready()
        run = sc.submit("--chunk-size", "4")
        sc.wait_terminal(run, deadline_s=400)
        rep = sc.check(run, ids, run_status="completed", statuses={"done": 9, "errored": 3})
        assert rep.error_codes == {"worker_lost": 3}
        assert rep.attempts[f"{run}-00001"] == 3, rep.attempts  # 2 crashes + the delivery that dead-letters
        assert rep.attempts[f"{run}-00000"] == 1 and rep.attempts[f"{run}-00002"] == 1, rep.attempts
        out = json.loads(sc.cli("status", run, "--json").stdout.splitlines()[-1])
        assert out["counts"]["errored"] == 3 and out["status"] == "completed"
        errs = sc.tmp / "err.jsonl"
        sc.cli("results", run, "-o", str(sc.tmp / "ok.jsonl"), "--errors", str(errs))
        lines = [json.loads(x) for x in errs.read_text().splitlines()]
        lost = sorted(x["custom_id"] for x in lines)
        assert len(lost) == 3 and {ids[6], ids[7]} < set(lost) and set(lost) < set(ids[4:8])
        assert {x["error"]["code"] for x in lines} == {"worker_lost"}
        assert w.alive() and w.log().count("WorkerLostError") >= 2


def test_t8_t9_soft_and_hard_time_limits_keep_partial_rows_without_a_loop(scenario):
    """T8: a row overruns the soft limit → rows done so far kept, the rest errored/timeout, the
    chunk is acked once. T9: a row stuck where the soft limit cannot reach it (SIGUSR1 blocked,
    like native code) → the hard limit kills the child, Celery replaces it, the same happens to the
    chunk's rows, and no delivery repeats. Continuous batching with 2 slots: the slow (hang) row is
    fed once one of the chunk's first two rows finishes, so the other one, still in flight, ends with
    it: three rows of each of those chunks end errored/timeout."""
    with scenario(db="postgresql", soft_time_limit=15, hard_time_limit=20, visibility_timeout=25) as sc:
        ids = sc.write_input(12)
        slow, hang = ids[2], ids[6]  # third row of chunk 0 / of chunk 1
        w = sc.worker(
            extra={"CANVASQ_TEST_DELAY_S": "40", "CANVASQ_TEST_SLOW": slow, "CANVASQ_TEST_HANG": hang}
        )
        first_child = None
        w.wait_ready()
        first_child = w.child_pids()[0]
        run = sc.submit("--chunk-size", "4")
        sc.wait_terminal(run, deadline_s=400)
        rep = sc.check(run, ids, run_status="completed", statuses={"done": 6, "errored": 6})
        assert rep.error_codes == {"timeout": 6}, rep.describe()
        rows = {**probes.chunk_rows(sc.store, f"{run}-00000"), **probes.chunk_rows(sc.store, f"{run}-00001")}
        errored = {c for c, st in rows.items() if st == "errored"}
        assert {ids[2], ids[3], ids[6], ids[7]} < errored and len(errored) == 6
        # no loop: the two time-limited chunks were delivered once each. (A message the main process
        # reserved while the hard limit killed the child can be delivered twice; that is harmless,
        # the duplicate finds no queued row.)
        assert rep.attempts[f"{run}-00000"] == 1 and rep.attempts[f"{run}-00001"] == 1, rep.attempts
        assert sc.redis.queue_length(sc.queue) == 0 and probes.unacked(sc.redis.client()) == 0
        log = w.log(100_000)
        assert "Soft time limit" in log and "Hard time limit" in log
        assert w.alive() and first_child not in w.child_pids()  # the child was replaced
        with sc.store.Session() as s:
            msgs = list(
                s.scalars(select(Chunk.last_error).where(Chunk.run_id == run, Chunk.last_error.is_not(None)))
            )
        assert len(msgs) == 2 and any("hard time limit" in m for m in msgs), msgs


def test_t12_cancel_mid_run_keeps_partial_rows_and_masks_secrets(scenario):
    """T12: cancel while a chunk runs → the run goes cancelling → cancelled, rows finished before
    stay done, the running chunk stops between steps, no chunk that had not started does any work.
    Security: the database and broker passwords never appear in worker logs or CLI output."""
    pg_secret, redis_secret = "pgS3cretVal", "rdS3cretVal"
    with scenario(
        db="postgresql",
        pg_password=pg_secret,
        redis_password=redis_secret,
        extra={"CANVASQ_TEST_DELAY_S": "2"},
    ) as sc:
        assert pg_secret in sc.db_url and redis_secret in sc.redis.url
        ids = sc.write_input(16)
        w = sc.worker()
        w.wait_ready()
        outputs = []
        sub = sc.cli("submit", str(sc.input_path), "--queue", sc.queue, "--chunk-size", "4")
        outputs.append(sub.stdout + sub.stderr)
        run = sub.stdout.strip().splitlines()[-1]
        sc.wait_rows(run, 2)
        cancel = sc.cli("cancel", run)
        started = {c for c, n in probes.chunk_attempts(sc.store, run).items() if n}  # ⊇ running at cancel
        outputs.append(cancel.stdout + cancel.stderr)
        assert cancel.stdout.strip().endswith(("cancelling", "cancelled"))
        done_at_cancel = sc.store.counts(run)["done"]
        sc.wait_terminal(run)
        rep = sc.check(run, ids, run_status="cancelled")
        assert set(rep.statuses) == {"done", "cancelled"}, rep.describe()
        assert done_at_cancel <= rep.statuses["done"] <= done_at_cancel + 2  # at most the batch in flight
        for cid in set(rep.attempts) - started:  # not started at cancel time: no row did any work
            assert set(probes.chunk_rows(sc.store, cid).values()) == {"cancelled"}, cid

        for args in (
            ("status", run),
            ("status", run, "--json"),
            ("runs",),
            ("config",),
            ("db", "current"),
            ("results", run),
            ("status", "run_doesnotexist"),
            ("workers",),
        ):
            res = sc.cli(*args, check=False)
            outputs.append(res.stdout + res.stderr)
        text = "\n".join(outputs) + w.log(1_000_000)
        assert pg_secret not in text and redis_secret not in text
        assert "***" in "\n".join(outputs)  # masked, not missing
        assert "no run 'run_doesnotexist'" in "\n".join(outputs)


def test_t13_deadline_expires_unfinished_rows_t15_retry_reruns_only_those(scenario):
    """T13: a run past its deadline → `canvasq reconcile` makes unfinished rows expired, finished
    rows stay. T15: `canvasq retry` re-runs only the expired rows (a reconcile pass meanwhile does
    not expire them again) and the results merge: every row done, the old ones untouched."""
    # the CLI's pass is the one under test: the worker's own periodic pass (CANVASQ_RECONCILE_S)
    # would expire the run first now and then
    with scenario(db="postgresql", extra={"CANVASQ_TEST_DELAY_S": "2", "CANVASQ_RECONCILE_S": "0"}) as sc:
        ids = sc.write_input(12)
        w = sc.worker()
        w.wait_ready()
        run = sc.submit("--chunk-size", "4", "--deadline", "3600")
        with sc.store.Session() as s:
            deadline = s.scalar(select(Run.deadline_at).where(Run.id == run))
        assert deadline is not None and deadline > utcnow() + timedelta(minutes=50)
        sc.wait_rows(run, 2)
        with sc.store.Session.begin() as s:  # the clock moves an hour on: the run is past its deadline
            hour = timedelta(seconds=3601)
            s.execute(
                update(Run)
                .where(Run.id == run)
                .values(deadline_at=Run.deadline_at - hour, created_at=Run.created_at - hour)
            )
        rec = sc.cli("reconcile")
        assert "expired 1 runs" in rec.stdout, rec.stdout
        assert sc.status(run) == "expired"
        rep = sc.check(run, ids, run_status="expired")
        assert set(rep.statuses) == {"done", "expired"}, rep.describe()
        finished = probes.outputs_snapshot(sc.store, run)
        done_before = {c for c, v in finished.items() if v[1] is None}
        expired = set(ids) - done_before
        wait_for(
            lambda: sc.redis.queue_length(sc.queue) == 0 and probes.unacked(sc.redis.client()) == 0,
            "the expired run's messages drained",
            120,
            diagnose=sc.logs,
        )
        assert sc.store.counts(run)["done"] == len(done_before), "no row finished after expiry"

        retry = sc.cli("retry", run)
        assert f"re-queued {len(expired)} rows" in retry.stdout, retry.stdout
        with sc.store.Session() as s:  # a fresh deadline of the original length
            assert s.scalar(select(Run.deadline_at).where(Run.id == run)) > utcnow() + timedelta(minutes=50)
        sc.cli("reconcile")  # a periodic reconcile right after the retry
        sc.wait_terminal(run)
        sc.check(run, ids, run_status="completed", statuses={"done": 12})
        after = probes.outputs_snapshot(sc.store, run)
        assert {c: after[c] for c in done_before} == {c: finished[c] for c in done_before}
        assert all(after[c][1] is None for c in expired)
