"""`canvasq worker` subprocesses that a scenario can signal: the whole worker (Celery's main
process) or its pool child (where the model runs and chunks are processed).

    env = worker_env(db_url=..., broker_url=redis.url, visibility_timeout=20, ...)
    with WorkerProcess(env, queue, log_dir / "w0.log") as w:
        w.wait_ready()                  # the child registered and loaded the model
        w.kill_child(signal.SIGKILL)    # T1: Celery replaces the child, the chunk is redelivered
        w.send(signal.SIGTERM)          # T3: warm shutdown
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Self

from tests.harness.waiting import wait_for

READY_MARK = "canvasq child ready"  # logged by the worker child once the model is loaded


def worker_env(
    *,
    db_url: str,
    broker_url: str,
    model: str | None = None,
    soft_time_limit: int = 60,
    hard_time_limit: int = 80,
    visibility_timeout: int = 100,
    max_attempts: int = 3,
    decode_batch_size: int = 2,
    chunk_size: int = 4,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a test-sized worker on CPU (one thread: the CI machine has two cores)."""
    from tests.harness.backends import model_for_tests

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANVASQ_")}
    env.update(
        {
            "CANVASQ_DATABASE_URL": db_url,
            "CANVASQ_BROKER_URL": broker_url,
            "CANVASQ_MODEL": model or model_for_tests(),
            "CANVASQ_DEVICE": "cpu",
            "CANVASQ_TORCH_THREADS": "1",
            "CANVASQ_SOFT_TIME_LIMIT": str(soft_time_limit),
            "CANVASQ_HARD_TIME_LIMIT": str(hard_time_limit),
            "CANVASQ_VISIBILITY_TIMEOUT": str(visibility_timeout),
            "CANVASQ_MAX_ATTEMPTS": str(max_attempts),
            "CANVASQ_DECODE_BATCH_SIZE": str(decode_batch_size),
            "CANVASQ_CHUNK_SIZE": str(chunk_size),
            "CANVASQ_HEARTBEAT_S": "2",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(x) for x in fh.read().split()]
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


class WorkerProcess:
    """One `canvasq worker` (Celery prefork, concurrency 1) in its own process group."""

    def __init__(
        self,
        env: dict[str, str],
        queue: str,
        log_path: str | Path,
        pool: str = "prefork",
        extra_args: tuple[str, ...] = (),
    ):
        self.env, self.queue, self.log_path, self.pool = env, queue, Path(log_path), pool
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.ready_count = 0  # READY_MARK lines seen when wait_ready last returned

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - the worker's log while it runs (closed in stop)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "canvasq.cli",
                "worker",
                "--queue",
                self.queue,
                "--loglevel",
                "INFO",
                "--pool",
                self.pool,
                *self.extra_args,
            ],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def ready_marks(self) -> int:
        try:
            return self.log_path.read_text(errors="replace").count(READY_MARK)
        except OSError:
            return 0

    def child_pids(self) -> list[int]:
        return [p for p in children(self.pid) if alive(p)] if self.alive() else []

    def wait_ready(self, deadline_s: float = 240) -> int:
        """Wait until a (new) pool child has loaded the model; returns the child's pid."""
        before = self.ready_count
        wait_for(
            lambda: self.ready_marks() > before and (self.pool == "solo" or self.child_pids()),
            f"worker {self.pid} ready",
            deadline_s,
            fail_if=lambda: None if self.alive() else f"worker exited rc={self.proc.returncode}",
            diagnose=self.log,
        )
        self.ready_count = self.ready_marks()
        return self.pid if self.pool == "solo" else self.child_pids()[0]

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill_child(self, sig: int = signal.SIGKILL) -> int:
        kids = self.child_pids()
        assert kids, f"worker {self.pid} has no pool child\n{self.log()}"
        os.kill(kids[0], sig)
        return kids[0]

    def kill_all(self) -> None:
        """SIGKILL the whole worker: main process and pool child at once (no goodbye to Redis)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait_exit(self, deadline_s: float = 120) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.pid} did not exit within {deadline_s}s\n{self.log()}"
            ) from None

    def stop(self) -> None:
        """Warm shutdown, then SIGKILL the group if it lingers; closes the log."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)  # stray pool children too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
