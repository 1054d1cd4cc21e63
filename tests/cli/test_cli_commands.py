"""The CLI commands end to end in-process: `run` (embedded, the real test model), then `runs`,
`status`, `results`, `trace --plot`, `retry`, `cancel`, `reconcile` against the same store and the
real Redis."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.core.queue import ResultRecord
from canvasq.core.schemas import Job
from canvasq.core.settings import REPO_ROOT, get_settings
from canvasq.core.store import Store
from canvasq.core.tables import utcnow
from tests.harness.backends import model_for_tests, queue_length


def invoke(*args):
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output + res.stderr
    return res


@pytest.fixture
def small_file(tmp_path):
    lines = [json.loads(x) for x in (REPO_ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:4]]
    for line in lines:  # one canvas each keeps the test short
        if "body" in line:
            line["body"]["max_tokens"] = 32
        else:
            line["max_tokens"] = 32
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path, [x["custom_id"] for x in lines]


def test_embedded_run_then_queries(small_file, service_env, monkeypatch, tmp_path):
    monkeypatch.setenv("CANVASQ_TORCH_THREADS", "1")
    path, ids = small_file
    out = tmp_path / "res.jsonl"
    res = invoke("run", str(path), "-o", str(out), "--decoder", "official", "--model", model_for_tests())
    assert "official" in res.stdout and "tok/s" in res.stdout and "wrote 4 results and 0 errors" in res.stdout
    assert "fwd/req" in res.stdout  # forwards per request, not a sum that counts shared passes twice
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ids
    assert all(x["error"] is None and x["response"]["body"]["usage"]["completion_tokens"] > 0 for x in lines)

    runs = json.loads(invoke("runs", "--json").stdout)
    assert len(runs) == 1 and (runs[0]["status"], runs[0]["total"], runs[0]["done"]) == ("completed", 4, 4)
    run_id = runs[0]["run_id"]
    assert json.loads(invoke("runs", "--json", "--status", "running").stdout) == []
    st = json.loads(invoke("status", run_id, "--json").stdout)
    assert st["counts"]["done"] == 4 and st["completion_tokens"] == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in lines
    )
    assert (
        "4/4 generated  completed" in invoke("status", run_id, "--watch", "--interval", "0.1").stdout
    )  # ends at once
    assert [
        json.loads(x)["custom_id"] for x in invoke("results", run_id, "--ordered").stdout.splitlines()
    ] == ids

    png = tmp_path / "t.png"
    tr = invoke("trace", run_id, ids[0], "--plot", str(png))
    assert "forwards" in tr.stdout and png.read_bytes()[:4] == b"\x89PNG"
    trace_rows = json.loads(invoke("trace", run_id, ids[0], "--json").stdout)
    assert trace_rows and [r["forward"] for r in trace_rows] == sorted(r["forward"] for r in trace_rows)
    assert CliRunner().invoke(cli, ["trace", run_id, "nope"]).exit_code != 0

    # retry of an embedded run re-decodes only the errored row, in process
    store = Store(service_env["url"])
    with store.Session.begin() as s:
        from sqlalchemy import update

        from canvasq.core.tables import Request

        s.execute(
            update(Request)
            .where(Request.run_id == run_id, Request.custom_id == ids[1])
            .values(status="errored")
        )
    invoke("retry", run_id, "--only", "errored")
    assert store.counts(run_id)["done"] == 4 and store.run_status(run_id) == "completed"
    store.dispose()


def test_cancel_retry_reconcile_on_the_queue(service_env):
    """Queue-mode control commands: messages land on (and only on) the run's Redis queue."""
    store = Store(service_env["url"])
    store.upgrade()
    q = service_env["queue"]
    jobs = [Job(f"c{i}", "p", "math", 32, None, i + 1) for i in range(6)]
    run = store.create_run(jobs, model="m", queue=q, chunk_size=2)  # stored, never published: a crash
    assert queue_length(q) == 0
    invoke("reconcile")
    assert queue_length(q) == 3 and store.unpublished_chunks() == []
    invoke("reconcile")
    assert queue_length(q) == 3  # nothing published twice

    # a chunk whose worker vanished (no heartbeat renews its lease any more) and whose message Redis
    # lost: once the lease has expired → re-published
    store.claim_chunk(run.chunk_ids[0], "gone", lease_s=1, max_attempts=3)
    with store.Session.begin() as s:
        from sqlalchemy import update

        from canvasq.core.tables import Chunk

        s.execute(
            update(Chunk)
            .where(Chunk.id == run.chunk_ids[0])
            .values(lease_expires_at=utcnow() - timedelta(seconds=get_settings().visibility_timeout + 5))
        )
    invoke("reconcile")
    assert queue_length(q) == 4

    store.write_results(
        run.run_id,
        [
            ResultRecord("c0", text="x", completion_tokens=1),
            ResultRecord("c1", status="errored", error_code="decode_error"),
        ],
        "w",
    )
    res = json.loads(invoke("cancel", run.run_id, "--json").stdout)
    assert res["status"] == "cancelled"  # chunks no worker held are cancelled at once
    c = store.counts(run.run_id)
    assert (
        (c["done"], c["errored"], c["cancelled"])
        == (1, 1, 4)
        == tuple(res["counts"][k] for k in ("done", "errored", "cancelled"))
    )
    listed = json.loads(invoke("runs", "--json").stdout)[0]
    assert (listed["cancelled"], listed["expired"]) == (4, 0)
    assert "cancelled" in invoke("runs").stdout.splitlines()[0]
    bar = invoke("status", run.run_id).stdout  # a cancelled run never shows a full bar
    assert "2/6 generated" in bar and "[##########xxxxxxxxxxxxxxxxxxxx]" in bar, bar
    before = queue_length(q)
    res = json.loads(invoke("retry", run.run_id, "--only", "errored,cancelled", "--json").stdout)
    # the run's own chunk size (2), not CANVASQ_CHUNK_SIZE (16): 5 rows in 3 chunks
    assert (res["rows"], res["chunks"], res["chunk_size"]) == (5, 3, 2) and queue_length(q) == before + 3
    assert store.counts(run.run_id)["queued"] == 5 and store.run_status(run.run_id) == "queued"
    bad = CliRunner().invoke(cli, ["retry", run.run_id, "--only", "done"])
    assert bad.exit_code != 0
    store.dispose()


def test_submit_same_key_twice_is_one_run(service_env):
    """T14: the same file and key submitted twice → the same run id, one set of chunk messages."""
    q = service_env["queue"]
    args = [
        "submit",
        str(REPO_ROOT / "examples" / "prompts.jsonl"),
        "--queue",
        q,
        "--key",
        "nightly-7",
        "--chunk-size",
        "8",
    ]
    first = invoke(*args).stdout.strip().splitlines()[-1]
    assert queue_length(q) == 3
    second = invoke(*args)
    assert second.stdout.strip().splitlines()[-1] == first
    assert "nothing published" in second.stderr
    assert queue_length(q) == 3
    assert len(json.loads(invoke("runs", "--json").stdout)) == 1


def test_submit_without_key_defaults_to_file_and_parameters(service_env):
    """The default idempotency key is a hash of the file, model and parameters: resubmitting the
    same file is the same run; other parameters make a new one."""
    q = service_env["queue"]
    base = ["submit", str(REPO_ROOT / "examples" / "prompts.jsonl"), "--queue", q]
    first = invoke(*base, "--chunk-size", "8").stdout.strip().splitlines()[-1]
    again = invoke(*base, "--chunk-size", "8")
    assert again.stdout.strip().splitlines()[-1] == first and "nothing published" in again.stderr
    other = invoke(*base, "--chunk-size", "6").stdout.strip().splitlines()[-1]
    assert other != first
    assert queue_length(q) == 3 + 4
