"""A dead worker is noticed in seconds, not after the broker's visibility timeout (issue 19, part 5).

Two real `canvasq worker` processes with the service's default lease settings (visibility timeout
3,600 s, hard / soft limits 2,100 / 1,800 s, lease 60 s, heartbeat 15 s, reconcile every 15 s by the
workers themselves: no reconcile process runs here). SIGKILL of one worker's main process, the PID
a user would note, mid-chunk: its Celery child dies with it, the chunk's lease lapses, a worker's
reconcile pass re-publishes it, and the other worker runs its rows within 2 minutes. `canvasq
workers` shows the dead one offline; every row is stored exactly once and the rows the dead worker
finished are neither redone nor rewritten.

The only settings changed from the defaults are ones a user could set too: CANVASQ_CHUNK_SIZE /
CANVASQ_DECODE_BATCH_SIZE (small chunks), CANVASQ_DEVICE=cpu and CANVASQ_TORCH_THREADS=1 (the CI
machine), and a test-only delay per decode batch (CANVASQ_TEST_DELAY_S) that makes "mid-chunk" a
wide window.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections import Counter

from canvasq.core.settings import Settings
from tests.harness import probes
from tests.harness.waiting import wait_for
from tests.harness.workers import alive

DEFAULTS = Settings.model_fields
DEFAULT_LIMITS = {
    k: DEFAULTS[k].default
    for k in ("soft_time_limit", "hard_time_limit", "visibility_timeout", "max_attempts")
}


def _default_env(sc, **extra):
    env = sc.env(extra={"CANVASQ_TEST_DELAY_S": "1.5", **extra})
    env.pop("CANVASQ_HEARTBEAT_S", None)  # worker_env shortens it for other tests: here the default
    for k in ("CANVASQ_LEASE_S", "CANVASQ_RECONCILE_S"):
        assert k not in env
    return env


def test_sigkill_of_worker_main_process_reruns_its_chunk_elsewhere_within_two_minutes(scenario):
    assert (
        DEFAULT_LIMITS["visibility_timeout"],
        DEFAULTS["lease_s"].default,
        DEFAULTS["heartbeat_s"].default,
        DEFAULTS["reconcile_s"].default,
    ) == (3600, 60, 15.0, 15.0)
    with scenario(db="postgresql", chunk_size=4, decode_batch_size=2, **DEFAULT_LIMITS) as sc:
        ids = sc.write_input(8)  # two chunks: one for each worker
        work = sc.tmp / "work.log"
        # 4 s before each 2-row batch: the window in which A's chunk has rows done and rows queued is
        # the second batch's wait, wide enough for a poll starved by a loaded CI machine
        env = _default_env(sc, CANVASQ_TEST_WORK_LOG=str(work), CANVASQ_TEST_DELAY_S="4")
        a, b = sc.worker(start=False), sc.worker(start=False)
        a.env = b.env = env
        a.start()
        b.start()
        a_child, b_child = a.wait_ready(), b.wait_ready()
        host = socket.gethostname()
        a_id, b_id = f"{host}:{a_child}", f"{host}:{b_child}"
        run = sc.submit("--chunk-size", "4")

        # A is mid-chunk: some of its chunk's rows done, some still queued
        def a_mid_chunk():
            for c, w in probes.running_chunks(sc.store, run).items():
                sts = set(probes.chunk_rows(sc.store, c).values())
                if w == a_id and "queued" in sts and sts - {"queued"}:
                    return c
            return None

        cid = wait_for(a_mid_chunk, "worker A mid-chunk", 180, every_s=0.1, diagnose=sc.logs)
        a.send(signal.SIGKILL)  # the main process only, as `kill -9 <pid of canvasq worker>`
        killed_at = time.monotonic()
        before = probes.outputs_snapshot(sc.store, run)
        rows_then = probes.chunk_rows(sc.store, cid)
        done_then = {c for c, st in rows_then.items() if st != "queued"}
        left_then = set(rows_then) - done_then
        assert done_then and left_then, rows_then
        wait_for(
            lambda: not alive(a_child), "A's Celery child to die with its main process", 30, diagnose=sc.logs
        )

        # the rows A left are decoded again, by B, within 2 minutes of the kill
        def rerun_by_b():
            return {c for pid, c in probes.work_log(work) if pid == b_child and c in left_then}

        wait_for(
            lambda: rerun_by_b(),
            "B running the dead worker's rows",
            120 - (time.monotonic() - killed_at),
            every_s=0.5,
            diagnose=lambda: sc.progress(run) + "\n" + sc.logs(),
        )
        took = time.monotonic() - killed_at
        assert took < 120, took

        # `canvasq workers`: A offline (no heartbeat for 3 × 15 + 10 s), B online
        def states():
            rows = json.loads(sc.cli("workers", "--json", env=env).stdout.splitlines()[-1])
            return {r["worker"]: r["online"] for r in rows}

        wait_for(
            lambda: states().get(a_id) is False,
            "A shown offline",
            120 - (time.monotonic() - killed_at),
            every_s=2,
            diagnose=lambda: str(states()),
        )
        assert states()[b_id] is True
        table = sc.cli("workers", env=env).stdout
        assert any(a_id in line and "offline" in line for line in table.splitlines()), table

        sc.wait_terminal(run, deadline_s=240)
        rep = sc.check(run, ids, run_status="completed", statuses={"done": 8})
        assert rep.attempts[cid] == 2, rep.attempts  # the original delivery + the one re-publish
        after = probes.outputs_snapshot(sc.store, run)
        assert {c: after[c] for c in before} == before  # rows A finished: untouched
        by_worker = Counter(after[c][2] for c in rows_then)
        assert by_worker[a_id] == len(done_then) and by_worker[b_id] == len(left_then), by_worker
        decoded = probes.work_log(work)
        assert not {c for pid, c in decoded if pid == b_child} & done_then  # done rows not redone
        assert all(n <= 2 for n in Counter(c for _, c in decoded).values())
        assert "re-publishing 1 chunk(s)" in b.log(1_000_000)  # B's own reconcile pass did it
        print(f"dead worker's rows running again after {took:.0f} s")


def test_a_live_worker_slower_than_its_lease_keeps_its_chunk(scenario):
    """Renewal is what keeps a slow chunk from being re-published (and its rows from being counted
    toward max_attempts = 2 and dead-lettered): each chunk here takes about three leases, the
    workers reconcile every second, and still every chunk is delivered once. Settings a user could
    set: CANVASQ_LEASE_S=9, CANVASQ_HEARTBEAT_S=2, CANVASQ_RECONCILE_S=1."""
    with scenario(db="sqlite", chunk_size=3, decode_batch_size=1, max_attempts=2) as sc:
        ids = sc.write_input(6)
        extra = {
            "CANVASQ_LEASE_S": "9",
            "CANVASQ_HEARTBEAT_S": "2",
            "CANVASQ_RECONCILE_S": "1",
            "CANVASQ_TEST_DELAY_S": "8",
        }
        a, b = sc.worker(extra=extra), sc.worker(extra=extra)
        a.wait_ready()
        b.wait_ready()
        run = sc.submit("--chunk-size", "3")
        sc.wait_terminal(run, deadline_s=300)
        rep = sc.check(run, ids, run_status="completed", statuses={"done": 6})
        assert set(rep.attempts.values()) == {1}, rep.attempts
        logs = a.log(1_000_000) + b.log(1_000_000)
        assert "re-publishing" not in logs
