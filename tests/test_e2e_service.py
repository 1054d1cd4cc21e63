"""End to end on the real services: 200 requests submitted through `canvasq submit`, two real
`canvasq worker` processes (Celery prefork, the test model on CPU) on the real Redis, the store on
PostgreSQL (a fresh database) and on SQLite. Checks: every custom_id has exactly one output and a
terminal status, `results` round-trips to the input ids, `runs` and `status` report the counts,
both workers registered and both did work, the queue is drained."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from canvasq.core.schemas import OPENAI_URLS
from canvasq.core.store import Store
from canvasq.core.tables import Output, Request, Worker
from tests.harness.backends import REDIS_URL, fresh_pg_database, model_for_tests, queue_length, unique_queue

N = 200
CHUNK = 25
pytestmark = pytest.mark.slow


def write_input(path: Path, n: int = N) -> list[str]:
    from canvasq.testbed import tasks

    math, code = tasks.generate("arith", n // 2, 7), tasks.generate("code", n - n // 2, 7)
    ids = []
    with open(path, "w") as fh:
        for i in range(n):
            task, p = ("math", math[i // 2]) if i % 2 == 0 else ("code", code[i // 2])
            cid = f"{task}-{i:04d}"
            if i % 4 < 2:
                line = {"custom_id": cid, "prompt": p.prompt, "task": task, "max_tokens": 32}
            else:
                line = {
                    "custom_id": cid,
                    "method": "POST",
                    "url": OPENAI_URLS[0],
                    "task": task,
                    "body": {"messages": [{"role": "user", "content": p.prompt}], "max_tokens": 32},
                }
            fh.write(json.dumps(line) + "\n")
            ids.append(cid)
    return ids


def canvasq(env, *args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canvasq.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


@contextlib.contextmanager
def workers(env, queue: str, n: int, log_dir: Path):
    procs = []
    try:
        for i in range(n):
            log = open(log_dir / f"worker{i}.log", "w")  # noqa: SIM115 - closed with its worker below
            procs.append(
                (
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "canvasq.cli",
                            "worker",
                            "--queue",
                            queue,
                            "--loglevel",
                            "INFO",
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    log,
                )
            )
        yield [p for p, _ in procs]
    finally:
        for p, _ in procs:  # warm shutdown, then make sure
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, log in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            log.close()


def wait_until(cond, what: str, procs, log_dir: Path, limit_s: float = 1200, every: float = 2.0):
    """Poll `cond` (a safety limit, not a timing assertion); fail early if a worker died."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            logs = "\n".join(f.read_text()[-3000:] for f in sorted(log_dir.glob("worker*.log")))
            pytest.fail(f"a worker exited ({dead[0].returncode}) while waiting for {what}:\n{logs}")
        time.sleep(every)
    logs = "\n".join(f.read_text()[-3000:] for f in sorted(log_dir.glob("worker*.log")))
    pytest.fail(f"gave up waiting for {what} after {limit_s}s:\n{logs}")


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'e2e.sqlite'}"
    else:
        with fresh_pg_database("canvasq_e2e") as url:
            yield url


def test_200_requests_two_workers(db_url, tmp_path):
    queue = unique_queue("canvasq.e2e")
    env = {
        **os.environ,
        "CANVASQ_DATABASE_URL": db_url,
        "CANVASQ_BROKER_URL": REDIS_URL,
        "CANVASQ_MODEL": model_for_tests(),
        "CANVASQ_TORCH_THREADS": "1",
        "CANVASQ_DEVICE": "cpu",
        "CANVASQ_DECODE_BATCH_SIZE": str(CHUNK),
        "CANVASQ_HEARTBEAT_S": "2",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    ids = write_input(tmp_path / "in.jsonl")
    canvasq(env, "db", "upgrade")
    store = Store(db_url)
    try:
        with workers(env, queue, 2, tmp_path) as procs:

            def registered():
                with store.Session() as s:
                    return (
                        s.scalar(select(func.count()).select_from(Worker).where(Worker.queue == queue)) == 2
                    )

            wait_until(registered, "both workers to register", procs, tmp_path)
            sub = canvasq(
                env,
                "submit",
                str(tmp_path / "in.jsonl"),
                "--queue",
                queue,
                "--chunk-size",
                str(CHUNK),
                "--decoder",
                "official",
                "--name",
                "e2e",
            )
            run_id = sub.stdout.strip().splitlines()[-1]
            assert run_id.startswith("run_")
            wait_until(
                lambda: store.run_status(run_id) == "completed", "the run to complete", procs, tmp_path
            )

        # exactly one output per custom_id, every row terminal and done
        with store.Session() as s:
            per_id = dict(
                s.execute(
                    select(Output.custom_id, func.count())
                    .where(Output.run_id == run_id)
                    .group_by(Output.custom_id)
                ).all()
            )
            statuses = dict(
                s.execute(
                    select(Request.status, func.count())
                    .where(Request.run_id == run_id)
                    .group_by(Request.status)
                ).all()
            )
            by_worker = dict(
                s.execute(
                    select(Output.worker_id, func.count())
                    .where(Output.run_id == run_id)
                    .group_by(Output.worker_id)
                ).all()
            )
            worker_rows = s.execute(select(Worker.id, Worker.device).where(Worker.queue == queue)).all()
        assert per_id == {cid: 1 for cid in ids}
        assert statuses == {"done": N}
        assert len(worker_rows) == 2 and {d for _, d in worker_rows} == {"cpu"}
        assert set(by_worker) == {w for w, _ in worker_rows}, "both workers should have done chunks"
        assert sum(by_worker.values()) == N
        assert queue_length(queue) == 0

        # results round-trip: OpenAI batch output lines, in input order with --ordered
        canvasq(
            env,
            "results",
            run_id,
            "-o",
            str(tmp_path / "out.jsonl"),
            "--errors",
            str(tmp_path / "err.jsonl"),
            "--ordered",
        )
        lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [x["custom_id"] for x in lines] == ids
        assert (tmp_path / "err.jsonl").read_text() == ""
        assert len({x["id"] for x in lines}) == N
        for x in lines:
            assert x["error"] is None and x["response"]["status_code"] == 200
            body = x["response"]["body"]
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert isinstance(body["choices"][0]["message"]["content"], str)
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            u = body["usage"]
            assert (
                0 < u["completion_tokens"] <= 32
                and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            )
        again = canvasq(env, "results", run_id, "--ordered").stdout.splitlines()
        assert [json.loads(x) for x in again] == lines  # stable export

        # runs and status report the same counts
        runs = json.loads(canvasq(env, "runs", "--json").stdout)
        mine = [r for r in runs if r["run_id"] == run_id]
        assert len(mine) == 1
        assert (
            mine[0]["status"],
            mine[0]["total"],
            mine[0]["done"],
            mine[0]["errored"],
            mine[0]["queued"],
        ) == ("completed", N, N, 0, 0)
        st = json.loads(canvasq(env, "status", run_id, "--json").stdout.splitlines()[-1])
        assert st["status"] == "completed"
        assert st["counts"] == {
            "queued": 0,
            "done": N,
            "errored": 0,
            "expired": 0,
            "cancelled": 0,
            "total": N,
        }
        assert st["completion_tokens"] == sum(
            x["response"]["body"]["usage"]["completion_tokens"] for x in lines
        )
        text_status = canvasq(env, "status", run_id).stdout
        assert f"{N}/{N} generated  completed" in text_status

        # a trace exists and plots
        cid = ids[0]
        canvasq(env, "trace", run_id, cid, "--plot", str(tmp_path / "t.png"))
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        store.dispose()
