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
