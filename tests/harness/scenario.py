"""One reliability scenario's world: a private Redis, a store (SQLite file, a fresh database on the
shared PostgreSQL, or a private PostgreSQL that may be stopped), a unique queue, worker
subprocesses, and the CLI run as a subprocess the way an operator would.

    with Scenario(tmp_path, db="sqlite", visibility_timeout=20) as sc:
        ids = sc.write_input(12)
        w = sc.worker(); w.wait_ready()
        run = sc.submit()
        sc.wait_terminal(run)
        sc.check(run, ids)
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Self

from canvasq.core.store import Store
from tests.harness import probes
from tests.harness.checks import RUN_TERMINAL, Report, assert_exactly_once
from tests.harness.services import PostgresServer, RedisServer
from tests.harness.waiting import wait_for
from tests.harness.workers import WorkerProcess, worker_env

MAX_TOKENS = 32  # one canvas of the testbed model: quick on CPU


def write_input(
    path: Path, n: int, prefix: str = "r", seed: int = 11, max_tokens: int = MAX_TOKENS
) -> list[str]:
    """n math prompts from the testbed's task generator, plain form; returns the custom_ids."""
    from canvasq.testbed import tasks

    problems = tasks.generate("arith", n, seed)
    ids = []
    with open(path, "w") as fh:
        for i, p in enumerate(problems):
            cid = f"{prefix}{i:05d}"
            fh.write(
                json.dumps({"custom_id": cid, "prompt": p.prompt, "task": "math", "max_tokens": max_tokens})
                + "\n"
            )
            ids.append(cid)
    return ids


class Scenario:
    def __init__(
        self,
        tmp: Path,
        *,
        db: str = "sqlite",
        redis_password: str | None = None,
        pg_password: str | None = None,
        **worker_kw,
    ):
        self.tmp = Path(tmp)
        self.db_kind = db
        self.queue = f"canvasq.rel.{uuid.uuid4().hex[:10]}"
        self.worker_kw = worker_kw
        self.redis = RedisServer(self.tmp, password=redis_password)
        self.pg: PostgresServer | None = None
        self.pg_password = pg_password
        self._stack = contextlib.ExitStack()
        self.workers: list[WorkerProcess] = []
        self.db_url = ""
        self.store: Store | None = None
        self.input_path = self.tmp / "input.jsonl"

    # -- set-up ------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self._stack.__enter__()
        self._stack.enter_context(self.redis)
        if self.db_kind == "sqlite":
            self.db_url = f"sqlite:///{self.tmp / 'canvasq.sqlite'}"
        elif self.db_kind == "postgresql":  # a fresh database on the shared server
            from tests.harness.backends import fresh_pg_database

            self.db_url = self._stack.enter_context(fresh_pg_database("canvasq_rel"))
            if self.pg_password:  # the shared server trusts local connections: any password works
                from sqlalchemy.engine import make_url

                self.db_url = (
                    make_url(self.db_url).set(password=self.pg_password).render_as_string(hide_password=False)
                )
        elif self.db_kind == "private-postgresql":  # a cluster of our own: may be stopped
            self.pg = self._stack.enter_context(PostgresServer(self.tmp, password=self.pg_password))
            self.db_url = self.pg.url()
        else:
            raise ValueError(self.db_kind)
        self.cli("db", "upgrade")
        self.store = Store(self.db_url)
        self._stack.callback(self.store.dispose)
        self._stack.callback(self.stop_workers)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def env(self, **overrides) -> dict[str, str]:
        kw = {**self.worker_kw, **overrides}
        extra = kw.pop("extra", None)
        return worker_env(db_url=self.db_url, broker_url=self.redis.url, extra=extra, **kw)

    # -- processes ---------------------------------------------------------------------------------
    def cli(
        self, *args: str, check: bool = True, env: dict | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(
            [sys.executable, "-m", "canvasq.cli", *args],
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
            check=False,  # `check` below raises with the CLI's output
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"canvasq {' '.join(args)} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
            )
        return res

    def worker(self, start: bool = True, **overrides) -> WorkerProcess:
        extra_args = overrides.pop("extra_args", ())
        pool = overrides.pop("pool", "prefork")
        w = WorkerProcess(
            self.env(**overrides),
            self.queue,
            self.tmp / f"worker{len(self.workers)}.log",
            pool=pool,
            extra_args=extra_args,
        )
        self.workers.append(w)
        return w.start() if start else w

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {w.log_path.name} (pid {w.proc.pid if w.proc else '-'})\n{w.log(3000)}"
            for w in self.workers
        )

    # -- runs --------------------------------------------------------------------------------------
    def write_input(self, n: int, **kw) -> list[str]:
        return write_input(self.input_path, n, **kw)

    def submit(self, *args: str, path: Path | None = None) -> str:
        res = self.cli(
            "submit", str(path or self.input_path), "--queue", self.queue, "--decoder", "official", *args
        )
        run_id = res.stdout.strip().splitlines()[-1]
        assert run_id.startswith("run_"), res.stdout + res.stderr
        return run_id

    def status(self, run_id: str) -> str | None:
        assert self.store is not None
        return self.store.run_status(run_id)

    def wait_mid_chunk(self, run_id: str, deadline_s: float = 180) -> str:
        """Until a chunk of the run is partly done; returns its id."""
        assert self.store is not None
        return wait_for(
            lambda: probes.mid_chunk(self.store, run_id),
            "a partially done chunk",
            deadline_s,
            every_s=0.1,
            diagnose=self.logs,
        )

    def wait_terminal(self, run_id: str, deadline_s: float = 240, statuses=RUN_TERMINAL) -> str:
        return wait_for(
            lambda: (st := self.status(run_id)) in statuses and st,
            f"run {run_id} to end",
            deadline_s,
            every_s=0.5,
            diagnose=lambda: self.progress(run_id) + "\n" + self.logs(),
        )

    def wait_rows(self, run_id: str, n_terminal: int, deadline_s: float = 240) -> None:
        """Until at least n_terminal rows of the run are terminal."""
        assert self.store is not None
        total = self.store.counts(run_id)["total"]
        wait_for(
            lambda: total - self.store.counts(run_id)["queued"] >= n_terminal,
            f"{n_terminal} terminal rows of {run_id}",
            deadline_s,
            every_s=0.2,
            diagnose=lambda: self.progress(run_id) + "\n" + self.logs(),
        )

    def progress(self, run_id: str) -> str:
        assert self.store is not None
        from tests.harness.checks import collect

        return collect(self.store, run_id, []).describe()

    def check(self, run_id: str, ids, **kw) -> Report:
        assert self.store is not None
        try:
            return assert_exactly_once(self.store, run_id, ids, **kw)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None
