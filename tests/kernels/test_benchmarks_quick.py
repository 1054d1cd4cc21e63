"""The kernel benchmarks run end to end at tiny shapes (`--quick`, Triton interpreter on CPU) and end
with a JSON line that says their outputs were checked."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canvasq.kernels.moe.quant import W4Config, bf16_bytes, pack_w4, packed_bytes

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


def test_packed_memory_real_shape():
    """30 layers x 128 experts at H=2816, I=704: packed experts fit the 14 GiB budget (BF16: 42.5 GiB),
    and the formula agrees with a real packing at a shape with the same structure."""
    assert packed_bytes(128, 2816, 704) * 30 / 2**30 <= 14.0
    assert abs(bf16_bytes(128, 2816, 704) * 30 / 2**30 - 42.54) < 0.01
    p = pack_w4(torch.randn(2, 2 * 88, 256), torch.randn(2, 256, 88), W4Config(scale_dtype=torch.float16))
    assert p.nbytes() == packed_bytes(2, 256, 88)


@pytest.mark.parametrize(  # tiny shapes: seconds each, so in the default run (the GPU checks run them too)
    "script,args",
    [
        ("moe_w4.py", ["--quick"]),
        ("rmsnorm.py", ["--quick"]),
        ("softmax_argmax.py", ["--quick"]),
        ("soft_embed.py", ["--quick"]),
        ("structured.py", ["--quick"]),
        ("tune_moe.py", ["--quick", "--dry"]),
        ("fp8_grouped.py", ["--quick"]),
    ],
)
def test_benchmark_quick(script, args, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == script.removesuffix(".py")
    if script != "tune_moe.py":
        assert last["correct"] is True
        assert (tmp_path / f"{last['bench']}.json").exists()


PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"


@pytest.mark.parametrize(
    "probe",
    [
        "router_gpu_timing.py",
        "attention_gpu_timing.py",
        "norm_fusion_gpu_timing.py",
        "moe_ncu_driver.py",
        "forward_kernels.py",
        "expert_order_gpu_timing.py",
        "launch_cost_gpu.py",
        "constraint_step_gpu.py",
        pytest.param(
            "moe_gluon_gpu_timing.py",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon: CUDA")],
        ),
    ],
)
def test_probe_quick(probe, tmp_path):
    """Every kept probe runs on the tree as it is (`--quick`: tiny shapes, on CPU through the Triton
    interpreter), checks its arms' outputs against each other or the twin, and exits 0."""
    assert {p.name for p in PROBES.glob("*.py")} == {
        "router_gpu_timing.py",
        "attention_gpu_timing.py",
        "norm_fusion_gpu_timing.py",
        "moe_ncu_driver.py",
        "forward_kernels.py",
        "expert_order_gpu_timing.py",
        "launch_cost_gpu.py",
        "constraint_step_gpu.py",
        "moe_gluon_gpu_timing.py",
    }, "a new probe needs a --quick run here"
    proc = subprocess.run(
        [sys.executable, str(PROBES / probe), "--quick"],
        cwd=PROBES,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip(), "a probe prints what it measured"


def test_kernels_compile_for_sm90_without_spills():
    """Every kernel lowers to an H200 cubin (Triton's bundled ptxas, no GPU) and the default MoE tiles
    do not spill registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compile_check.py")],
        cwd=BENCH,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is True
    rows = [ast.literal_eval(ln) for ln in proc.stdout.splitlines() if ln.startswith("{'kernel'")]
    moe = {r["kernel"]: r for r in rows if r["kernel"] in ("gate_up", "down")}
    # the MoE loops' SASS size is reported (the offline measure of the dequantisation's cost)
    assert set(moe) == {"gate_up", "down"} and all(
        r["loop_instr"] > 0 and "HMMA" in r["loop_top"] for r in moe.values()
    )
    # the Gluon kernels at the H200 configs' Gluon tiles compile (their layout conversions are checked
    # trivial at compile time) and their loops keep the MMA
    gluon = [r for r in rows if r["kernel"].startswith("gluon_")]
    assert {r["kernel"].split()[0] for r in gluon} == {"gluon_gate_up", "gluon_down"}
    # spill-free, except the measured winners that spill a little (gluon_w4.MEASURED_SPILLS: the BLOCK_M 32
    # gate_up w2 t2 s3, 48 bytes; the 256-row down under its 72-register cap, 8 bytes); a layout change
    # that made any tile spill more would show here
    allowed = {"gluon_gate_up m32 w2 t2 s3": 48, "gluon_down m16 w4 t2 s3 r72": 8}
    assert all(r["stack"] <= allowed.get(r["kernel"], 0) for r in gluon), [
        (r["kernel"], r["stack"]) for r in gluon
    ]
    assert any(r["kernel"].endswith(" r72") for r in gluon)  # the configured register cap is compiled in
    assert all(r["loop_mma"] > 0 for r in gluon)
