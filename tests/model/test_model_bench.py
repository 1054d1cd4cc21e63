"""benchmarks/forward.py --quick runs on CPU and checks its own parity (the H200 run is the lead's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "forward.py"


@pytest.mark.slow
def test_forward_benchmark_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_forward", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summary = mod.main(["--quick", "--rows", "8", "--batches", "1,2", "--iters", "1", "--warmup", "0"])
    assert summary["parity_ok"] and len(summary["results"]) == 2
    assert all(r["bf16_err"] <= 1e-4 for r in summary["results"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["bench"] == "forward"
    assert (tmp_path / "forward.json").exists()


@pytest.mark.slow
def test_official_service_bench_dry_run(tmp_path):
    """benchmarks/official_service.py on the CPU against the testbed (its dry run): two knob arms drain
    the recorded requests through the worker's loop, every row is written, and `--trace` leaves a
    Chrome trace with the step labels and a device-time table."""
    import subprocess
    import sys

    script = BENCH.parent / "official_service.py"
    out, trace = tmp_path / "service.json", tmp_path / "trace"
    cmd = [
        sys.executable,
        str(script),
        "--target",
        "random:testbed",
        "--device",
        "cpu",
        "--batches",
        "3",
        "--n",
        "4",
        "--fp8",
        "off",
        "--warm",
        "partial",
        "--arms",
        "official;official:slot_order=false@context_step=64",
        "--out",
        str(out),
        "--trace",
        str(trace),
        "--trace-steps",
        "2,2",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**__import__("os").environ, "CANVASQ_COMMIT": "test"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["arm"] for r in report["service"]] == ["official", "official:slot_order=false@context_step=64"]
    assert all(r["written"] == 4 and r["tokens_replayed"] > 0 for r in report["service"])
    assert report["schedule"] == "replayed" and report["commit"] == "test" and len(report["bare"]) == 1
    events = json.loads(Path(f"{trace}.json").read_text())["traceEvents"]
    assert {"decoder_step", "encoder_pass"} <= {e.get("name") for e in events}
    assert "decoder_step" in Path(f"{trace}.txt").read_text()
