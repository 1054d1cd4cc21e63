"""The service benchmarks run end to end on the CPU at tiny sizes against the testbed (each a
subprocess, as a user runs it); their full runs are in BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "CANVASQ_COMMIT": "test"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_service_overhead(tmp_path):
    last = _json_lines(_run(tmp_path, "service_overhead.py", "--n", "6", "--max-tokens", "16"))[-1]
    assert last["bench"] == "service_overhead" and last["n"] == 6 and last["schedule"] == "real"
    assert last["plain_s"] > 0 and last["service_s"] > 0


def test_claim_ahead_on_the_bundled_example(tmp_path):
    """Plain and OpenAI batch lines alike (the bundled example alternates them); both arms write every
    row. Its four code lines (two canvases each; the arith lines' five made this CI's slowest test)."""
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(lines[1:9:2]) + "\n")  # code-01 .. code-04: plain, OpenAI, plain, OpenAI
    arms = _json_lines(
        _run(
            tmp_path,
            "claim_ahead.py",
            str(src),
            "--chunk",
            "2",
            "--slots",
            "4",
            "--reps",
            "1",
            "--threads",
            "1",
        )
    )
    assert [a["arm"] for a in arms] == ["off", "on"] and all(a["rows"] == 4 and a["tokens"] > 0 for a in arms)


def test_phcd_counters(tmp_path):
    _run(tmp_path, "phcd_counters.py", str(tmp_path / "out.json"), "--n", "1")
    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report) == {"arith", "code", "long"} and all(r["commits"] > 0 for r in report.values())


def test_slot_occupancy_replays_forward_counts(tmp_path):
    """Rows of 2, 4, 6 and 8 forwards (a `canvasq run` output's `usage.forwards`) through 2 slots. In
    chunks of 2: 4 steps at 6/8 busy, then 8 at 14/16. As one stream: rows 6 and 8 take the slots freed
    at steps 2 and 4, so 12 steps at 20/24 busy either way."""
    out = tmp_path / "results.jsonl"
    out.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "response": {"body": {"usage": {"forwards": f}}}}) + "\n"
            for i, f in enumerate((2, 4, 6, 8))
        )
    )
    text = _run(tmp_path, "slot_occupancy.py", str(out), "--slots", "2", "--chunks", "2,0")
    assert "4 rows, forwards per row: mean 5.00, max 8" in text
    assert "| 2 | 2 | 83% | 12 |" in text and "| 2 | all | 83% | 12 |" in text


def test_slot_occupancy_replays_longest_first_from_the_input(tmp_path):
    """Rows of 2, 2, 2 and 8 forwards with max_tokens 16, 16, 16, 64 through 2 slots as one stream.
    In file order the long row starts at step 3 and runs alone for 6 steps: 10 steps, 14/20 busy.
    Largest max_tokens first it starts at once beside the short ones: 8 steps, 14/16 busy."""
    out, src = tmp_path / "results.jsonl", tmp_path / "in.jsonl"
    out.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "response": {"body": {"usage": {"forwards": f}}}}) + "\n"
            for i, f in enumerate((2, 2, 2, 8))
        )
    )
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": "p", "max_tokens": m}) + "\n"
            for i, m in enumerate((16, 16, 16, 64))
        )
    )
    text = _run(tmp_path, "slot_occupancy.py", str(out), "--input", str(src), "--slots", "2", "--chunks", "0")
    assert "| 2 | all | 70% | 10 | 88% | 8 |" in text


def test_store_writes(tmp_path):
    text = _run(
        tmp_path,
        "store_writes.py",
        "--rows",
        "8",
        "--per",
        "4",
        "--traces",
        "2",
        "--reps",
        "1",
        "--db",
        "sqlite",
    )
    assert "SQLite: 1 row(s) per write: median" in text and "SQLite: 4 row(s) per write: median" in text


def test_trace_gaps_attributes_idle_gpu_time_to_the_host_label():
    """`benchmarks/trace_gaps.analyse` on a hand-made trace: a step whose kernels leave 30 µs idle
    inside `sample` and 50 µs between labels; the store label launches no kernel."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.trace_gaps import analyse

    host = {"pid": 1, "tid": 1, "ph": "X"}
    ev = [
        {**host, "cat": "user_annotation", "name": "decoder_step", "ts": 0, "dur": 100},
        {**host, "cat": "user_annotation", "name": "sample", "ts": 60, "dur": 40},
        {**host, "cat": "user_annotation", "name": "store_rows", "ts": 150, "dur": 40},
        {
            **host,
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 1,
            "dur": 1,
            "args": {"correlation": 1},
        },
        {
            **host,
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 61,
            "dur": 1,
            "args": {"correlation": 2},
        },
        {
            "pid": 0,
            "tid": 7,
            "ph": "X",
            "cat": "kernel",
            "name": "k1",
            "ts": 0,
            "dur": 60,
            "args": {"correlation": 1},
        },
        {
            "pid": 0,
            "tid": 7,
            "ph": "X",
            "cat": "kernel",
            "name": "k2",
            "ts": 90,
            "dur": 10,
            "args": {"correlation": 2},
        },
        {"pid": 0, "tid": 7, "ph": "X", "cat": "kernel", "name": "k3", "ts": 190, "dur": 0},
    ]
    out = analyse(ev)
    assert out["span_ms"] == 0.19 and out["gpu_busy_ms"] == 0.07
    assert out["idle_by_label_ms"] == {"store_rows": 0.04, "(none)": 0.05, "sample": 0.03}
    own = out["per_label_own"]
    assert own["decoder_step"]["gpu_ms"] == 0.06 and own["sample"]["gpu_ms"] == 0.01
    assert own["store_rows"]["gpu_ms"] == 0 and own["store_rows"]["count"] == 1


def test_official_steps_probe(tmp_path):
    """The steps-per-canvas probe (issue 35): every canvas runs at least two steps (HF's rule needs an
    argmax that held one step), and each canvas is either stability- or entropy-bound."""
    out = _run(tmp_path, "official_steps.py", "--n", "4", "--batch", "4", "--threads", "1")
    report = json.loads(out)
    for task in ("arith", "code"):
        got = report[task]
        assert got["canvases"] >= 4 and min(int(k) for k in got["steps_histogram"]) >= 2
        assert got["stability_bound"] + got["entropy_bound"] == got["canvases"]


def test_structured_output_pooled_stream_with_a_knob_arm_per_value(tmp_path):
    """`structured_output.py --pooled --stream`: every seed's lines as one arm through one stream (its
    steps and occupancy reported), an arm per value of a knob given several, every row valid; with
    `--rounds 2` all of it twice, the same documents each round; `--phases`: each arm's host time a step
    split by phase."""
    out = tmp_path / "report.json"
    args = [
        "--n",
        "2",
        "--seeds",
        "3",
        "4",
        "--pooled",
        "--stream",
        "--batch",
        "2",
        "--schemas",
        "answer",
        "--free-last",
        "--rounds",
        "2",
        "--phases",
    ]
    _run(tmp_path, "structured_output.py", *args, "--open-hold", "1", "-1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["pooled"] and report["constraint_open_hold"] == [1, None]
    arms = {a["arm"]: a for a in report["arms"]}
    names = (
        "free/answer/seeds3-4",
        "answer/open1/seeds3-4",
        "answer/openNone/seeds3-4",
        "free_last/seeds3-4",
    )
    assert set(arms) == {f"{n}/r{r}" for n in names for r in (1, 2)}
    for a in arms.values():
        assert a["rows"] == 4 and a["steps"] > 0 and 0 < a["occupancy_mean"] <= 1
        # --phases: host ms a step per phase, each phase's own time, the rest what none covered
        ms = a["phase_ms_step"]
        assert {"step", "forward", "sample", "encode"} <= set(ms) and all(v >= 0 for v in ms.values())
        assert sum(ms.values()) == pytest.approx(1e3 * a["wall_s"] / a["steps"], rel=1e-3)
        assert {"mask", "final", "begin"} <= set(ms)  # the constraint's hooks run for every row
        if not a["arm"].startswith(("free/", "free_last/")):  # and their parts for constrained rows
            parts = {"mask_rows", "mask_constrain", "mask_best", "mask_rules", "mask_pin", "final_read"}
            assert parts <= set(ms)  # (`mask_plans`: the kernel path's plan table, on CUDA)
    for r in (1, 2):
        assert (
            arms[f"answer/open1/seeds3-4/r{r}"]["valid"]
            == arms[f"answer/openNone/seeds3-4/r{r}"]["valid"]
            == 4
        )
    assert arms["answer/open1/seeds3-4/r1"]["fwd_req"] == arms["answer/open1/seeds3-4/r2"]["fwd_req"]


def test_overhead_ratios_read_each_arm_against_the_free_runs_beside_it():
    """Issue 36's bar: a constrained arm against the mean of the nearest free runs before and after it in
    its round, not the round's first free run; the median over rounds per arm."""
    from benchmarks.overhead_ratios import best_of, bracketed, medians

    def arm(name, tok):
        return {"arm": name, "tok_s": tok}

    arms = [
        arm("free/a/seeds1/r1", 100.0),
        arm("a/seeds1/r1", 90.0),
        arm("free/b/seeds1/r1", 80.0),  # the host slowed: b is read against 80 and 60
        arm("b/seeds1/r1", 63.0),
        arm("prompt_only/b/seeds1/r1", 1.0),
        arm("free_last/seeds1/r1", 60.0),
        arm("free/a/seeds1/r2", 100.0),
        arm("a/seeds1/r2", 80.0),
        arm("free/b/seeds1/r2", 100.0),
        arm("b/seeds1/r2", 95.0),  # no free run after it: read against the one before
    ]
    by_round = bracketed(arms)
    assert by_round["seeds1/r1"] == pytest.approx({"a": 90 / 90 - 1, "b": 63 / 70 - 1})
    assert by_round["seeds1/r2"] == pytest.approx({"a": 80 / 100 - 1, "b": 95 / 100 - 1})
    assert medians(by_round) == pytest.approx({"a": -0.1, "b": (-0.1 - 0.05) / 2})
    assert best_of(arms) == pytest.approx({"a": 90 / 100 - 1, "b": 95 / 100 - 1})


def test_structured_output_free_each_brackets_every_schema_with_free_runs(tmp_path):
    """`--free-each`: the free lines run again before each schema after the first, so the report's run
    order is free, schema, free, schema, ..., free_last, and `overhead_ratios.py` reads every schema."""
    out = tmp_path / "report.json"
    args = ["--n", "2", "--seeds", "3", "--pooled", "--stream", "--batch", "2", "--free-last", "--free-each"]
    _run(tmp_path, "structured_output.py", *args, "--schemas", "answer", "change", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["free_each"]
    order = [a["arm"].split("/seeds")[0] for a in report["arms"]]
    assert order == ["free/answer", "answer", "free/change", "change", "free_last"]
    printed = _run(tmp_path, "overhead_ratios.py", str(out))
    assert "median vs free: answer " in printed and "; change " in printed
