"""`canvasq serve` as a subprocess for the Batch API tests: its own process group, a free port, a
log file, and its memory (RSS of the server and, with --with-worker, separately of its child).

    with ServerProcess(env, tmp / "serve.log", with_worker=True) as srv:
        srv.wait_ready()
        client = OpenAI(base_url=srv.base_url, api_key=key)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Self

from tests.harness.waiting import wait_for

if TYPE_CHECKING:
    from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`canvasq ARGS` in a subprocess (stdout, stderr captured as text)."""
    res = subprocess.run(
        [sys.executable, "-m", "canvasq.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and res.returncode != 0:
        raise AssertionError(f"canvasq {' '.join(args)} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


class ServerProcess:
    def __init__(
        self, env: dict[str, str], log_path: str | Path, with_worker: bool = False, port: int | None = None
    ):
        self.env, self.log_path, self.with_worker = env, Path(log_path), with_worker
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop
        args = [
            sys.executable,
            "-m",
            "canvasq.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        if self.with_worker:
            args.append("--with-worker")
        self.proc = subprocess.Popen(
            args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
            return r.status == 200

    def wait_ready(self, deadline_s: float = 120) -> None:
        """The API answers; with --with-worker also its child has loaded the model."""
        from canvasq.serve.local_worker import READY_MARK

        wait_for(
            lambda: self._healthy() and (not self.with_worker or READY_MARK in self.log(10**7)),
            f"canvasq serve on {self.port}",
            deadline_s,
            fail_if=lambda: None if self.proc.poll() is None else f"server exited rc={self.proc.returncode}",
            diagnose=self.log,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(40)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)  # the local worker child too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------- client side

ENDPOINT = "/v1/chat/completions"
TERMINAL = ("completed", "failed", "cancelled", "expired")


def batch_lines(prefix: str, n: int, max_tokens: int = 8) -> bytes:
    rows = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": ENDPOINT,
            "body": {
                "model": "testbed",
                "max_tokens": max_tokens,
                "messages": [
                    {
                        "role": "user",
                        "content": f"Tom has {i} apples and buys {i % 7 + 2} more. "
                        "How many apples does he have?",
                    }
                ],
            },
        }
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: OpenAI, data: bytes, name: str = "batch.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def poll(client: OpenAI, batch_id: str, until=TERMINAL, deadline_s: float = 300, server=None):
    end = time.monotonic() + deadline_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        if time.monotonic() > end:
            raise AssertionError(
                f"batch {batch_id} still {b.status} ({b.request_counts}) after {deadline_s}s\n"
                f"{server.log() if server else ''}"
            )
        time.sleep(0.5)
