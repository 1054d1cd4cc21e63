"""Test-only fault hooks, inert unless their environment variable is set (the reliability suite
and scripts/soak.py set them on worker subprocesses; production never does). Each takes effect
when a decode batch is about to run, inside the decode call (where a real chunk spends its time).

    CANVASQ_TEST_POISON=q3,q7   the process dies (os._exit) on a batch holding one of these ids:
                                a poison chunk that crashes every worker it reaches (T7)
    CANVASQ_TEST_DELAY_S=2.5    each batch first sleeps this long (signals are handled promptly),
                                so "mid-chunk" is a wide, reliable window (T1, T3, T12, …);
    CANVASQ_TEST_SLOW=q5        … only batches holding one of these ids (all batches when unset)
    CANVASQ_TEST_HANG=q9        the batch hangs with SIGUSR1 blocked, like a native call that never
                                returns to Python: Celery's soft limit cannot interrupt it, only the
                                hard limit's SIGKILL ends it (T9)
    CANVASQ_TEST_WORK_LOG=PATH  append "<pid> <custom_id>" for every row about to be decoded: the
                                work actually done, to compare with one pass (T21)
    CANVASQ_TEST_REPLAY=PATH    a JSON {custom_id: [denoising steps per canvas]} recorded on the
                                testbed: the official decoder stops each canvas after its recorded
                                steps (`benchmarks/replay.py`, from the source checkout), so random
                                weights at the real shape run a real schedule (scripts/fleet.py;
                                loaded once, at the child's start)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

POISON_EXIT_CODE = 70


def _ids(var: str) -> set[str]:
    raw = os.environ.get(var)
    return set(raw.split(",")) if raw else set()


def before_decode(custom_ids: Iterable[str]) -> None:
    if not any(
        k in os.environ
        for k in ("CANVASQ_TEST_POISON", "CANVASQ_TEST_DELAY_S", "CANVASQ_TEST_HANG", "CANVASQ_TEST_WORK_LOG")
    ):
        return
    ids = list(custom_ids)
    if _ids("CANVASQ_TEST_POISON") & set(ids):
        os._exit(POISON_EXIT_CODE)
    log_path = os.environ.get("CANVASQ_TEST_WORK_LOG")
    if log_path:
        with open(log_path, "a") as fh:  # O_APPEND: lines from several processes never interleave
            fh.write("".join(f"{os.getpid()} {c}\n" for c in ids))
    if _ids("CANVASQ_TEST_HANG") & set(ids):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        time.sleep(float(os.environ.get("CANVASQ_TEST_HANG_S", "3600")))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    delay = os.environ.get("CANVASQ_TEST_DELAY_S")
    slow = _ids("CANVASQ_TEST_SLOW")
    if delay and (not slow or slow & set(ids)):
        end = time.monotonic() + float(delay)
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))


def install_replay() -> int:
    """Serve `official` with the replaying decoder of `benchmarks/replay.py` on the schedules in
    CANVASQ_TEST_REPLAY; returns the entries. The benchmarks live in the source checkout, beside the
    package."""
    path = os.environ.get("CANVASQ_TEST_REPLAY")
    if not path:
        return 0
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "replay.py").is_file():
        raise RuntimeError(
            f"CANVASQ_TEST_REPLAY needs the repository's benchmarks/replay.py (not found under {root})"
        )
    sys.path.insert(0, str(root))
    from benchmarks import replay

    with open(path) as fh:
        replay.OFFICIAL.update({str(k): [int(x) for x in v] for k, v in json.load(fh).items()})
    replay.install()
    return len(replay.OFFICIAL)
