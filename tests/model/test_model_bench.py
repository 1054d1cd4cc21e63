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


def test_forward_benchmark_without_a_reference_times_the_w4_bundle(tmp_path, monkeypatch):
    """`--no-ref` builds no HF BF16 model (the real shape's does not fit an 80 GiB card): our W4 arms
    run on the worker's random W4 bundle, each timed with its weight bytes; an arm it cannot build is
    refused at the command line."""
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_forward", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--quick", "--no-ref", "--rows", "8", "--batches", "2", "--iters", "1", "--warmup", "0"]
    summary = mod.main([*args, "--experts", "w4"])
    (res,) = summary["results"]
    assert res["w4_ms"] > 0 and res["w4_GBps"] > 0 and "w4_err" not in res and "hf_ms" not in res
    assert not any(k.endswith("_error") for k in res)
    with pytest.raises(SystemExit):
        mod.main([*args, "--experts", "bf16"])


@pytest.mark.slow
def test_official_service_bench_dry_run(tmp_path):
    """benchmarks/official_service.py on the CPU against the testbed (its dry run): two knob arms drain
    the recorded requests through the worker's loop (the second with its own window-count buckets),
    every row is written, and `--trace` leaves a Chrome trace with the step labels and a device-time
    table."""
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
        "official;official:slot_order=false@context_step=64,window_buckets=1/3/6",
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
    arms = ["official", "official:slot_order=false@context_step=64,window_buckets=1/3/6"]
    assert [r["arm"] for r in report["service"]] == arms
    from canvasq.decoders.base import WINDOW_BUCKETS  # the second arm's buckets, the first's the decoders'

    assert [r["window_buckets"] for r in report["service"]] == [list(WINDOW_BUCKETS), [1, 3, 6]]
    assert all(r["written"] == 4 and r["tokens_replayed"] > 0 for r in report["service"])
    # prompts and retired canvases ran encoder passes: the loop's rate over all its rows exceeds the decoder's
    assert all(r["encoder_rows"] > 0 and r["all_rows_per_s"] > r["rows_per_s"] for r in report["service"])
    assert report["schedule"] == "replayed" and report["commit"] == "test" and len(report["bare"]) == 1
    bare = report["bare"][0]
    assert bare["ms_per_forward"] > 0 and bare["ms_per_forward_no_head"] > 0 and not bare["head_deferred"]
    events = json.loads(Path(f"{trace}.json").read_text())["traceEvents"]
    assert {"decoder_step", "encoder_pass"} <= {e.get("name") for e in events}
    assert "decoder_step" in Path(f"{trace}.txt").read_text()


def test_bare_forward_makes_a_deferred_heads_logits_in_officials_row_groups():
    """The bare forward's figure includes the LM head: a deferred head is read over every row, in groups
    of whole windows under `defer_head_bytes` of fp32 logits, as official's step reads it."""
    from types import SimpleNamespace

    import torch

    from canvasq.model.windows import DecodeOutput

    spec = importlib.util.spec_from_file_location("bench_service", BENCH.parent / "official_service.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    C, V, windows = 4, 10, 5
    calls = []

    def head(h):
        calls.append(h[:, 0].tolist())
        return torch.zeros(len(h), V)

    hidden = torch.arange(windows * C, dtype=torch.float32)[:, None].repeat(1, 3)
    out = DecodeOutput(None, [w * C for w in range(windows + 1)], hidden=hidden, head=head)
    mod._head_rows(out, SimpleNamespace(defer_head_bytes=2 * 4 * C * V + 7, vocab_size=V), C)
    assert [len(c) for c in calls] == [2 * C, 2 * C, C]  # two windows a group, the last one alone
    assert [r for c in calls for r in c] == list(range(windows * C))
    calls.clear()
    mod._head_rows(DecodeOutput(torch.zeros(windows * C, V), [0]), SimpleNamespace(), C)
    assert not calls  # an eager forward's logits are whole already


def test_forward_kernels_groups_cutlass_grouped_gemms_and_our_attention():
    """The forward-by-kernel probe's groups match lowercased names: torch's FP8 grouped GEMM (a CUTLASS
    kernel named by its `GroupProblemShape`) is the experts' GEMM, not a dense one, and our attention
    kernel is attention."""
    spec = importlib.util.spec_from_file_location(
        "forward_kernels", BENCH.parent / "probes" / "forward_kernels.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cutlass = (
        "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJiiiE"
    )
    assert mod.group_of(cutlass) == "experts_gemm"
    assert mod.group_of("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT") == "lm_head_or_dense_gemm"
    assert mod.group_of("_attend_kernel") == "attention"
