"""Issue 22: the CLI a batch user lives in. Standard OpenAI lines routed by their content (task
inferred and stored per row), OpenAI body parameters honoured or refused by line, progress that
tells the truth, and history that says why. Real services: SQLite in tmp, the machine's Redis, the
testbed model on the CPU."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import select

import canvasq.cli.embedded as cli_mod
from canvasq.cli import cli
from canvasq.core.queue import ResultRecord
from canvasq.core.reports import active_wall, recent_rate
from canvasq.core.results import cut_at_stop
from canvasq.core.schemas import Limits, infer_task, parse_line
from canvasq.core.settings import REPO_ROOT, reload_settings
from canvasq.core.store import Store
from canvasq.core.tables import Request
from canvasq.testbed.tasks import generate
from tests.harness.backends import model_for_tests, queue_length


def invoke(*args, ok: bool = True):
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert res.exit_code == 0, res.output + res.stderr
    return res


def openai(cid: str, content: str, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "testbed", "messages": [{"role": "user", "content": content}], **body},
    }


def write(path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


# ---------------------------------------------------------------------------------------- task inference


def test_task_inferred_from_content():
    """The rule `--decoder auto` routes by when a line has no task: every generated problem of each
    family, the example file's lines, and prose with no inferable task (→ None: the accurate decoder)."""
    for task, name in (("arith", "math"), ("code", "code")):
        assert {infer_task(p.prompt) for p in generate(task, 300, 5)} == {name}
    for line in (REPO_ROOT / "examples" / "prompts.jsonl").read_text().splitlines():
        d = json.loads(line)
        text = d.get("prompt") or d["body"]["messages"][0]["content"]
        assert infer_task(text) == d["custom_id"].split("-")[0]
    assert infer_task("Ann has 5 pens. She buys 3 more. How many pens does Ann have?") == "math"
    assert infer_task("class Stack:\n    pass") == "code"
    for prose in ("Write a haiku about 3 cats.", "What is the capital of France?", "Say hello."):
        assert infer_task(prose) is None


def test_task_from_line_or_metadata_wins():
    lim = Limits(max_tokens_limit=1024, context_tokens=1024)
    job, _ = parse_line({**openai("a", "def f(x):\n    pass"), "task": "math"}, 1, lim)
    assert job.task == "math"
    job, _ = parse_line(openai("a", "Say hello.", metadata={"task": "code"}), 1, lim)
    assert job.task == "code"
    _, errs = parse_line(openai("a", "Say hello.", metadata={"task": "poetry"}), 1, lim)
    assert errs == ["unknown task 'poetry'; known: math, code"]


# ---------------------------------------------------------------------------------------- body parameters


def test_unhonourable_parameters_refused_with_line_numbers(service_env, tmp_path):
    """n > 1, temperature, top_p < 1, seed and parameters canvasq has no use for are refused at
    validation, each with its line; nothing is stored. n = 1, top_p = 1, user, metadata pass."""
    q = "Ann has 5 pens. How many pens?"
    f = write(
        tmp_path / "params.jsonl",
        [
            openai(
                "ok", q, n=1, top_p=1, user="u", metadata={"k": "v"}, stop=["\n"], max_completion_tokens=8
            ),
            openai("n3", q, n=3),
            openai("temp", q, temperature=0.2),
            openai("topp", q, top_p=0.5),
            openai("seed", q, seed=7),
            openai("bias", q, logit_bias={"5": 10}),
            openai("stops", q, stop=["a", "b", "c", "d", "e"]),
            openai("mt", q, max_tokens=99999),
        ],
    )
    res = invoke("run", f, "-o", str(tmp_path / "o.jsonl"), ok=False)
    assert res.exit_code == 2
    err = res.stderr
    assert "line 1" not in err
    for line_no, needle in (
        (2, "body.n=3: canvasq returns one choice per request"),
        (3, "body.temperature=0.2"),
        (4, "body.top_p=0.5"),
        (5, "body.seed=7: each row draws from its own generator"),
        (6, "body.logit_bias="),
        (7, "body.stop has 5 sequences; the limit is 4"),
        (8, "max_tokens 99999 is beyond the limit 1024 (the model's context: 1024 tokens"),
    ):
        assert f"line {line_no}: {needle}" in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_stop_cuts_the_text():
    assert cut_at_stop("a b ### c", ["###"], "length") == ("a b ", "stop")
    assert cut_at_stop("a b c", ["zz"], "length") == ("a b c", "length")
    assert cut_at_stop("x1y2", ["2", "1"], "stop") == ("x", "stop")  # the earliest sequence wins


def test_standard_openai_file_routed_by_content(service_env, tmp_path, monkeypatch):
    """An OpenAI file without `task`: the inferred task is stored per row and routes it (here
    CANVASQ_ROUTING sends math to pipe, so the routing is visible); a line with no inferable task
    goes to official; `stop` cuts the output and sets finish_reason "stop"; off a terminal, `run`
    prints progress lines."""
    monkeypatch.setenv("CANVASQ_TORCH_THREADS", "1")
    monkeypatch.setenv("CANVASQ_ROUTING", '{"math": "pipe"}')
    monkeypatch.setattr(cli_mod, "PROGRESS_EVERY_S", 0.0)
    reload_settings()
    math, code = generate("arith", 1, 3)[0], generate("code", 1, 3)[0]
    f = write(
        tmp_path / "std.jsonl",
        [
            openai("m", math.prompt, max_tokens=32, stop=" starts"),
            openai("c", code.prompt, max_tokens=32),
            openai("p", "Say hello.", max_tokens=8),
        ],
    )
    out = tmp_path / "out.jsonl"
    res = invoke("run", f, "-o", str(out), "--model", model_for_tests())
    assert "generating: 3 rows" in res.stderr and "generating: 3/3 rows (100 %)" in res.stderr, res.stderr
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    usage = {k: v["response"]["body"]["usage"]["decoder"] for k, v in lines.items()}
    assert usage == {"m": "pipe", "c": "official", "p": "official"}
    m = lines["m"]["response"]["body"]["choices"][0]
    assert m["finish_reason"] == "stop" and " starts" not in m["message"]["content"]
    store = Store(service_env["url"])
    with store.Session() as s:
        assert dict(s.execute(select(Request.custom_id, Request.task)).all()) == {
            "m": "math",
            "c": "code",
            "p": None,
        }
    store.dispose()


# ---------------------------------------------------------------------------------------- progress


def test_active_wall_and_rate():
    t0 = datetime(2026, 1, 1)
    at = [t0 + timedelta(seconds=s) for s in (10, 20, 30)]
    assert active_wall(t0, at) == 30
    # retried a day later: the idle day is not active time, so tok/s does not collapse or restart
    later = [t0 + timedelta(days=1, seconds=s) for s in (10, 20)]
    assert active_wall(t0, at + later) == 40
    assert (
        active_wall(t0, at, now=at[-1] + timedelta(seconds=5)) == 35
    )  # running: the time since the last row
    assert recent_rate(at) == pytest.approx(0.1)
    assert recent_rate(at[:1]) is None


def test_status_counts_in_flight_and_results_name_what_is_missing(service_env):
    """A queue run with one chunk held by a worker: status shows its rows in flight; results says the
    run is unfinished and names the missing rows; trace says why a row has none; resubmitting with
    another --name says it returned the existing run."""
    from canvasq.core.schemas import Job

    store = Store(service_env["url"])
    store.upgrade()
    run = store.create_run(
        [Job(f"r{i}", "p", "math", 8, None, i + 1) for i in range(4)],
        model="m",
        queue=service_env["queue"],
        chunk_size=2,
    )
    store.claim_chunk(run.chunk_ids[0], "w", 60, 3)
    store.write_results(
        run.run_id, [ResultRecord("r0", text="x", completion_tokens=3, forwards=2, decoder="hf")], "w"
    )
    st = json.loads(invoke("status", run.run_id, "--json").stdout)
    assert st["in_flight"] == 1 and st["counts"]["done"] == 1
    assert "(in flight 1)" in invoke("status", run.run_id).stdout

    res = invoke("results", run.run_id, "--json")
    report = json.loads(res.stderr.strip().splitlines()[-1])
    assert (report["results"], report["unfinished"], report["missing"]) == (1, 3, ["r1", "r2", "r3"])
    res = invoke("results", run.run_id)
    assert "3 of 4 rows" in res.stderr and "not in the output: r1, r2, r3" in res.stderr

    why = CliRunner().invoke(cli, ["trace", run.run_id, "r1"])
    assert why.exit_code == 1 and "not finished (queued)" in why.stderr
    assert "has no row with that custom_id" in CliRunner().invoke(cli, ["trace", run.run_id, "zz"]).stderr
    assert "stored no per-forward trace" in CliRunner().invoke(cli, ["trace", run.run_id, "r0"]).stderr
    store.dispose()


def test_resubmit_with_another_name_says_so(service_env, tmp_path):
    q = service_env["queue"]
    f = write(tmp_path / "sub.jsonl", [openai("a", "Ann has 5 pens. How many pens?", max_tokens=8)])
    first = json.loads(invoke("submit", f, "--queue", q, "--name", "one", "--json").stdout)
    assert first["created"] and first["published"] == 1 and first["name"] == "one"
    again = invoke("submit", f, "--queue", q, "--name", "two")
    assert again.stdout.strip() == first["run_id"]
    assert "returned the existing run" in again.stderr and "--name 'two' was not applied" in again.stderr
    assert json.loads(invoke("submit", f, "--queue", q, "--json").stdout)["created"] is False
    assert queue_length(q) == 1


def test_db_downgrade_asks(service_env):
    invoke("db", "upgrade")
    res = invoke("db", "downgrade", "base", ok=False)
    assert res.exit_code == 1 and "pass --yes" in res.stderr
    assert "downgraded to base" in invoke("db", "downgrade", "base", "--yes").stdout


def test_pipe_run_prints_no_future_warning(tmp_path):
    """A pipe / funnel run merges the D2F adapter, and peft calls a deprecated transformers method
    there: the merge filters that one warning, so a run's stderr carries no FutureWarning."""
    import os
    import subprocess
    import sys

    path = write(
        tmp_path / "p.jsonl",
        [
            {
                "custom_id": "a",
                "prompt": "Ann has 5 pens. She buys 3 more. How many pens does Ann have now?",
                "task": "math",
                "max_tokens": 32,
            }
        ],
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANVASQ_")}
    env.update(
        CANVASQ_MODEL=model_for_tests(),
        CANVASQ_DATABASE_URL=f"sqlite:///{tmp_path / 'w.sqlite'}",
        PYTHONWARNINGS="default",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canvasq.cli",
            "run",
            path,
            "-o",
            str(tmp_path / "o.jsonl"),
            "--decoder",
            "pipe",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wrote 1 results and 0 errors" in proc.stdout
    assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]
