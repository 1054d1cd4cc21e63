"""Issue 19, part 4: embedded runs resume. A `canvasq run` interrupted (SIGINT) or killed (SIGKILL)
is marked `interrupted`; the same command again continues it, reusing every row finished before,
and writes each custom_id exactly once (through a temporary file renamed into place: a killed run
never leaves a half-written output). Cancel + retry re-runs every cancelled row, `results` names the
rows that are not terminal, and `submit` after a failed publish publishes what was left. Real
processes, the real test model on CPU, real SQLite / Redis."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update

from canvasq.cli import cli
from canvasq.core.queue import ResultRecord
from canvasq.core.schemas import Job
from canvasq.core.settings import REPO_ROOT, get_settings
from canvasq.core.store import Store
from canvasq.core.tables import Chunk, Output, Request
from tests.harness.backends import REDIS_URL, drop_queue, model_for_tests, queue_length, unique_queue
from tests.harness.services import TcpProxy

N = 16
OLD = "old results\n"


def _write_input(path: Path, n: int = N) -> list[str]:
    ids = [f"q{i:02d}" for i in range(n)]
    path.write_text(
        "".join(
            json.dumps(
                {"custom_id": c, "prompt": f"What is {i} plus {i + 3}?", "task": "math", "max_tokens": 8}
            )
            + "\n"
            for i, c in enumerate(ids)
        )
    )
    return ids


def _done_ids(url: str) -> dict[str, object]:
    """custom_id -> output updated_at of every finished row (any run in the store)."""
    st = Store(url)
    try:
        with st.Session() as s:
            rows = s.execute(
                select(Request.custom_id, Output.updated_at)
                .join(Output, (Output.run_id == Request.run_id) & (Output.custom_id == Request.custom_id))
                .where(Request.status == "done")
            ).all()
        return dict(rows)
    except Exception:  # noqa: BLE001 - tables not created yet
        return {}
    finally:
        st.dispose()


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so Python installs its Ctrl-C handler.
    A suite started as a background job without job control (`cmd &` in a script) inherits SIGINT
    ignored, and Python then keeps ignoring it: the run would finish instead of stopping."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(env: dict, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "canvasq.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),
        text=True,
        preexec_fn=_default_sigint,  # noqa: PLW1509 - no threads touch the child before exec
    )


def _wait_done(proc: subprocess.Popen, url: str, at_least: int, log: Path, timeout_s: float = 240) -> None:
    end = time.monotonic() + timeout_s
    while len(_done_ids(url)) < at_least:
        assert proc.poll() is None, f"run ended early: rc {proc.returncode}\n{log.read_text()[-3000:]}"
        assert time.monotonic() < end, "no progress"
        time.sleep(0.05)


def _work_log(path: Path) -> dict[int, list[str]]:
    by_pid: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        pid, cid = line.split()
        by_pid.setdefault(int(pid), []).append(cid)
    return by_pid


def test_sigint_then_sigkill_then_rerun_every_id_once_and_work_reused(tmp_path):
    db = tmp_path / "canvasq.sqlite"
    url = f"sqlite:///{db}"
    src = tmp_path / "in.jsonl"
    ids = _write_input(src)
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    work = tmp_path / "work.log"
    env = {
        **os.environ,
        "CANVASQ_DATABASE_URL": url,
        "CANVASQ_MODEL": model_for_tests(),
        "CANVASQ_TORCH_THREADS": "1",
        "CANVASQ_TEST_WORK_LOG": str(work),
        # each fed batch sleeps 1 s first: the interrupts land mid-run even when this test process is
        # starved on a loaded 2-core box
        "CANVASQ_TEST_DELAY_S": "1.0",
    }
    args = ["run", str(src), "-o", str(out), "--decoder", "funnel", "--chunk-size", "2"]

    # 1. Ctrl-C after a few rows: exit 130, run `interrupted`, output untouched
    p = _start(env, args, tmp_path / "run1.log")
    _wait_done(p, url, 2, tmp_path / "run1.log")
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 130, (tmp_path / "run1.log").read_text()
    err1 = (tmp_path / "run1.log").read_text()
    assert "interrupted: run" in err1 and "run the same command again to continue" in err1
    assert "Traceback" not in err1
    st = Store(url)
    (run,) = st.list_runs()
    assert run["status"] == "interrupted" and 2 <= run["done"] < N
    with st.Session() as s:  # a clean stop releases its chunk and does not count the delivery
        chunks = s.execute(select(Chunk.status, Chunk.attempts).where(Chunk.run_id == run["run_id"])).all()
    assert "running" not in {c.status for c in chunks} and max(c.attempts for c in chunks) <= 1
    assert out.read_text() == OLD

    # 2. the same command, SIGKILLed mid-run: it resumed (reused the first rows), made progress, died
    p = _start(env, args, tmp_path / "run2.log")
    done_before_2 = len(_done_ids(url))
    _wait_done(p, url, done_before_2 + 2, tmp_path / "run2.log")
    p.kill()
    p.wait(timeout=30)
    assert f"{done_before_2} of {N} rows reused" in (tmp_path / "run2.log").read_text()
    assert out.read_text() == OLD  # the killed process never wrote it in place
    done_at_kill = _done_ids(url)
    assert len(done_at_kill) < N, "the kill came too late to test anything"
    get_settings.cache_clear()
    res = CliRunner().invoke(cli, ["runs", "--json"], env={"CANVASQ_DATABASE_URL": url})
    get_settings.cache_clear()
    assert json.loads(res.stdout)[0]["status"] == "interrupted", res.stdout + res.stderr

    # 3. the same command again: finishes, every custom_id exactly once, earlier rows reused untouched
    p = _start(env, args, tmp_path / "run3.log")
    stdout, _ = p.communicate(timeout=120)
    err3 = (tmp_path / "run3.log").read_text()
    assert p.returncode == 0, err3
    assert f"{len(done_at_kill)} of {N} rows reused" in err3
    assert f"{len(done_at_kill)} rows reused from the earlier run" in stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ids
    assert all(x["error"] is None for x in lines)
    after = _done_ids(url)
    assert set(after) == set(ids)
    assert all(after[c] == t for c, t in done_at_kill.items())  # not rewritten
    by_pid = _work_log(work)
    assert len(by_pid) == 3
    last = list(by_pid.values())[-1]  # the third process's rows
    assert not set(last) & set(done_at_kill), "the rerun decoded rows finished before the kill"
    assert set(last) == set(ids) - set(done_at_kill)
    assert len(st.list_runs()) == 1 and st.list_runs()[0]["status"] == "completed"
    assert not [
        x for x in tmp_path.iterdir() if x.name.endswith(".tmp")
    ]  # the killed run's temp file is gone
    st.dispose()


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'canvasq.sqlite'}"
    monkeypatch.setenv("CANVASQ_DATABASE_URL", url)
    monkeypatch.setenv("CANVASQ_BROKER_URL", REDIS_URL)
    monkeypatch.setenv("CANVASQ_TORCH_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    yield {"url": url, "tmp": tmp_path, "mp": monkeypatch}
    monkeypatch.undo()
    get_settings.cache_clear()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def invoke(*args):
    get_settings.cache_clear()
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output + res.stderr
    return res


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_lands_in_a_finaliser_still_stops_the_run(env, monkeypatch):
    """Python ignores an exception raised inside a finaliser or weakref callback ("Exception ignored
    in ..."): a Ctrl-C that lands there once let the run finish with exit 0 (CI, SQLAlchemy's
    InstanceState._cleanup). The run still stops at its next row: exit 130, `interrupted`, rows left."""
    from canvasq.worker.engine import Engine

    src = env["tmp"] / "in.jsonl"
    _write_input(src, 6)
    original = Engine.run_chunk

    def run_chunk(self, cid):
        class Dropped:
            pass

        dropped = Dropped()
        weakref.finalize(dropped, signal.getsignal(signal.SIGINT), signal.SIGINT, None)
        del dropped  # the Ctrl-C handler runs inside the finaliser; its KeyboardInterrupt is ignored
        return original(self, cid)

    monkeypatch.setattr(Engine, "run_chunk", run_chunk)
    monkeypatch.setenv("CANVASQ_MODEL", model_for_tests())
    get_settings.cache_clear()
    args = ["run", str(src), "-o", "out.jsonl", "--decoder", "funnel", "--chunk-size", "2"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 130, res.output + res.stderr
    assert "interrupted: run" in res.stderr and "Traceback" not in res.stderr
    st = Store(env["url"])
    (run,) = st.list_runs()
    assert run["status"] == "interrupted" and run["done"] < 6
    assert not Path("out.jsonl").exists()
    st.dispose()


def test_cancel_then_retry_reruns_every_cancelled_row_of_an_interrupted_run(env):
    """The state a killed `canvasq run` leaves: one chunk `running` with one row done and one still
    queued, its owner dead. `results` names the 5 unfinished rows; `cancel` cancels all of them
    (the in-flight chunk's too); `retry --only cancelled` re-runs all 5."""
    st = Store(env["url"])
    st.upgrade()
    jobs = [Job(f"r{i}", f"What is {i} plus 1?", "math", 8, None, i + 1) for i in range(6)]
    created = st.create_run(
        jobs, model=model_for_tests(), queue="embedded", decoder="funnel", chunk_size=2, mode="embedded"
    )
    run_id = created.run_id
    owner = f"embedded:{socket.gethostname()}:{_dead_pid()}"
    st.register_worker(
        owner,
        socket.gethostname(),
        int(owner.rsplit(":", 1)[1]),
        "cpu",
        model_for_tests(),
        f"embedded:{run_id}",
    )
    claim = st.claim_chunk(created.chunk_ids[0], owner, 3600, 3)
    assert claim.state == "work" and len(claim.requests) == 2
    st.write_results(run_id, [ResultRecord("r0", text="1", completion_tokens=1, decoder="funnel")], owner)

    res = invoke("results", run_id, "-o", "partial.jsonl")
    assert "5 of 6 rows of" in res.stderr and "not finished (interrupted)" in res.stderr
    assert [json.loads(x)["custom_id"] for x in Path("partial.jsonl").read_text().splitlines()] == ["r0"]

    assert invoke("cancel", run_id).stdout.strip().endswith("cancelled")
    c = st.counts(run_id)
    assert (c["cancelled"], c["queued"], c["done"]) == (5, 0, 1)

    res = invoke("retry", run_id, "--only", "cancelled")
    assert f"{run_id}: re-ran 5 rows" in res.stdout
    c = st.counts(run_id)
    assert (c["done"], c["queued"], c["cancelled"]) == (6, 0, 0)
    assert st.get_run(run_id).status == "completed"
    assert "not finished" not in invoke("results", run_id, "-o", "all.jsonl").stderr
    st.dispose()


def test_retry_of_an_interrupted_run_also_runs_rows_left_queued(env):
    """`retry --only errored` on an interrupted run: the errored row and the rows the interruption
    left queued all run (none stays queued forever)."""
    st = Store(env["url"])
    st.upgrade()
    jobs = [Job(f"r{i}", f"What is {i} plus 2?", "math", 8, None, i + 1) for i in range(4)]
    created = st.create_run(
        jobs, model=model_for_tests(), queue="embedded", decoder="funnel", chunk_size=2, mode="embedded"
    )
    run_id = created.run_id
    owner = f"embedded:{socket.gethostname()}:{_dead_pid()}"
    st.claim_chunk(created.chunk_ids[0], owner, 3600, 3)
    st.write_results(
        run_id, [ResultRecord("r0", status="errored", error_code="decode_error", error_message="x")]
    )
    res = invoke("retry", run_id, "--only", "errored")
    assert "re-ran 1 rows in ['errored'] and 3 left unfinished by an interruption" in res.stdout
    assert st.counts(run_id)["done"] == 4
    st.dispose()


def test_rerun_while_the_first_is_alive_is_refused(env):
    """Two `canvasq run` of the same file and settings never generate one run at once: a live owner
    (a process running canvasq on this host) makes the second refuse; a dead one is taken over."""
    st = Store(env["url"])
    st.upgrade()
    src = env["tmp"] / "in.jsonl"
    _write_input(src, 2)
    env["mp"].setenv("CANVASQ_MODEL", model_for_tests())
    invoke("run", str(src), "-o", "a.jsonl", "--decoder", "funnel")
    (run,) = st.list_runs()
    with st.Session.begin() as s:  # one row back to queued: there is work to fight over
        s.execute(update(Request).where(Request.custom_id == "q00").values(status="queued"))
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "canvasq"])
    try:
        st.register_worker(
            "embedded:other", socket.gethostname(), owner.pid, "cpu", "m", f"embedded:{run['run_id']}"
        )
        get_settings.cache_clear()
        res = CliRunner().invoke(cli, ["run", str(src), "-o", "b.jsonl", "--decoder", "funnel"])
        assert res.exit_code == 1 and "is being generated by process" in res.stderr, res.stderr
        assert not Path("b.jsonl").exists()
    finally:
        owner.kill()
        owner.wait()
    res = invoke("run", str(src), "-o", "b.jsonl", "--decoder", "funnel")  # owner dead: resumed
    assert "1 rows reused from the earlier run" in res.stdout
    st.dispose()


def test_fresh_starts_over_and_output_replaced_atomically(env):
    src = env["tmp"] / "in.jsonl"
    ids = _write_input(src, 2)
    env["mp"].setenv("CANVASQ_MODEL", model_for_tests())
    invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel")
    res = invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel")
    assert "2 rows reused from the earlier run" in res.stdout and "loading" not in res.stderr
    res = invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel", "--fresh")
    assert "reused" not in res.stdout
    st = Store(env["url"])
    assert len(st.list_runs()) == 2
    st.dispose()
    assert [json.loads(x)["custom_id"] for x in Path("o.jsonl").read_text().splitlines()] == ids
    assert oct(Path("o.jsonl").stat().st_mode & 0o777) != "0o600"  # not the temp file's private mode
    assert not [p for p in env["tmp"].iterdir() if p.name.endswith(".tmp")]


def test_submit_after_publish_failure_publishes_the_unpublished_chunks(env, monkeypatch):
    """The broker answers the up-front check, then fails while the chunks are published: the run is
    stored, the message says what to do, and the same `submit` again publishes every chunk."""
    import canvasq.cli.queue as cli_mod  # where `submit` looks its check up

    queue = unique_queue()
    proxy = TcpProxy(("127.0.0.1", int(REDIS_URL.split(":")[2].split("/")[0])))
    monkeypatch.setenv("CANVASQ_BROKER_URL", f"redis://127.0.0.1:{proxy.port}/0")
    src = REPO_ROOT / "examples" / "prompts.jsonl"
    real_check = cli_mod.check_broker
    monkeypatch.setattr(cli_mod, "check_broker", lambda settings: None)  # the outage starts after the check
    try:
        get_settings.cache_clear()
        res = CliRunner().invoke(cli, ["submit", str(src), "--queue", queue, "--chunk-size", "5"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.stderr
        assert (
            "is stored but publishing its chunks" in res.stderr
            and "run the same `canvasq submit` again" in res.stderr
        )
        st = Store(env["url"])
        (run,) = st.list_runs()
        assert len(st.unpublished_chunks(run["run_id"])) == 5 and queue_length(queue) == 0

        monkeypatch.setattr(cli_mod, "check_broker", real_check)
        proxy.accept()
        res = invoke("submit", str(src), "--queue", queue, "--chunk-size", "5")
        assert res.stdout.strip() == run["run_id"]
        assert "published its 5 unpublished chunk(s)" in res.stderr
        assert queue_length(queue) == 5 and st.unpublished_chunks(run["run_id"]) == []
        res = invoke("submit", str(src), "--queue", queue, "--chunk-size", "5")
        assert (
            "nothing published (every chunk was published before)" in res.stderr and queue_length(queue) == 5
        )
        st.dispose()
    finally:
        proxy.refuse() if proxy._listener else None
        drop_queue(queue)


def test_rerun_with_other_lease_and_reconcile_intervals_resumes(env):
    """Lease and reconcile intervals change when work is re-published, never what it generates:
    the same `canvasq run` with other CANVASQ_LEASE_S / CANVASQ_RECONCILE_S continues the run; a
    setting that changes tokens (CANVASQ_SEED) starts another."""
    src = env["tmp"] / "in.jsonl"
    _write_input(src, 2)
    env["mp"].setenv("CANVASQ_MODEL", model_for_tests())
    invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel")
    env["mp"].setenv("CANVASQ_LEASE_S", "90")
    env["mp"].setenv("CANVASQ_RECONCILE_S", "5")
    res = invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel")
    assert "2 rows reused from the earlier run" in res.stdout and "loading" not in res.stderr
    env["mp"].setenv("CANVASQ_SEED", "7")
    res = invoke("run", str(src), "-o", "o.jsonl", "--decoder", "funnel")
    assert "reused" not in res.stdout
    st = Store(env["url"])
    assert len(st.list_runs()) == 2
    st.dispose()
