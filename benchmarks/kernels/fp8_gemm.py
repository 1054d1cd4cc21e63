"""FP8 against BF16 and W4 for the GEMMs of one real-shape layer, by row count (H200).

    python3 benchmarks/kernels/fp8_gemm.py            # H200: M = 256 ... 8192
    python3 benchmarks/kernels/fp8_gemm.py --quick    # CPU smoke (torch twins, tiny shapes)

Per M: the dense GEMMs (q/k/v, o, dense gate/up and down, the LM head) as bf16 `F.linear` and as
torch's row-scaled FP8 GEMM on pre-quantised rows; the row quantisation alone (torch ops and the
Triton kernel); and the routed experts (K = 8 of 128) as bf16 grouped GEMMs, W4A16 (Gluon) and FP8
(`model.fp8.fp8_moe`). Times are `triton.testing.do_bench` medians (ms); TFLOP/s count 2·M·N·K.
With $OUT set, rows go to $OUT/fp8_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from _common import DEVICE, ON_GPU, time_ms

from canvasq.model.experts import moe_grouped
from canvasq.model.fp8 import FP8Experts, FP8Linear, fp8_linear, fp8_moe, quantize_rows

H, E, TOPK, I = 2816, 128, 8, 704
DENSE = {
    "qkv": (8192, H),
    "o": (H, 4096),
    "mlp_gate_up": (4224, H),
    "mlp_down": (H, 2112),
    "head": (262144, H),
}


def dense_rows(m: int, dtype) -> list[dict]:
    return [
        dense_row(m, name, n, k, dtype) for name, (n, k) in DENSE.items() if not (name == "head" and m > 4096)
    ]


def dense_row(m: int, name: str, n: int, k: int, dtype) -> dict:
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    q = FP8Linear.from_weight(w)
    xq, xs = quantize_rows(x)
    row = {"M": m, "gemm": name, "N": n, "K": k}
    row["bf16_ms"] = time_ms(lambda _: F.linear(x, w))
    if ON_GPU:
        for acc in (True, False):
            row[f"fp8_{'fast' if acc else 'exact'}_ms"] = time_ms(
                lambda _, acc=acc: torch._scaled_mm(
                    xq,
                    q.q.t(),
                    scale_a=xs[:, None],
                    scale_b=q.scale[None, :],
                    out_dtype=dtype,
                    use_fast_accum=acc,
                )
            )
        from canvasq.kernels.fp8_quant import quantize_rows_triton

        row["quant_triton_ms"] = time_ms(lambda _: quantize_rows_triton(x))
    row["quant_torch_ms"] = time_ms(lambda _: quantize_rows(x))
    row["fp8_linear_ms"] = time_ms(lambda _: fp8_linear(x, q))
    for key in ("bf16_ms", "fp8_fast_ms"):
        if key in row:
            row[key.replace("_ms", "_tflops")] = 2 * m * n * k / (row[key] * 1e-3) / 1e12
    return row


def expert_rows(m: int, dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(m)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(DEVICE, dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(DEVICE, dtype)
    x = torch.randn(m, H, device=DEVICE, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)]).to(DEVICE)
    w = torch.rand(m, TOPK, device=DEVICE)
    ex = FP8Experts.from_weights(gate_up, down)
    row = {"M": m, "gemm": "experts", "flop": 2 * m * TOPK * 3 * H * I}
    row["bf16_grouped_ms"] = time_ms(lambda _: moe_grouped(x, ids, w, gate_up, down))
    row["fp8_moe_ms"] = time_ms(lambda _: fp8_moe(x, ids, w, ex))
    if ON_GPU:  # what the runtime runs: the combine left to the end-of-layer norm
        row["fp8_moe_deferred_ms"] = time_ms(lambda _: fp8_moe(x, ids, w, ex, defer_combine=True))
    if ON_GPU:
        from canvasq.kernels.moe import pack_w4, w4_moe
        from canvasq.kernels.moe.launch import prefer_tiled

        packed = prefer_tiled(pack_w4(gate_up, down), dtype)
        row["w4_ms"] = time_ms(lambda _: w4_moe(x, ids, w, packed))
        # the FP8 grouped GEMMs alone, on rows already quantised and sorted
        flat = ids.reshape(-1)
        sorted_e, order = torch.sort(flat, stable=True)
        offs = torch.searchsorted(sorted_e, torch.arange(1, E + 1, device=DEVICE)).to(torch.int32)
        xq, xs = quantize_rows(x[order // TOPK])
        row["fp8_gate_up_gemm_ms"] = time_ms(
            lambda _: torch._scaled_grouped_mm(
                xq,
                ex.gate_up.transpose(-2, -1),
                xs,
                ex.gate_up_scale,
                offs=offs,
                out_dtype=dtype,
                use_fast_accum=True,
            )
        )
        aq, as_ = quantize_rows(torch.randn(m * TOPK, I, device=DEVICE, dtype=dtype))
        row["fp8_down_gemm_ms"] = time_ms(
            lambda _: torch._scaled_grouped_mm(
                aq,
                ex.down.transpose(-2, -1),
                as_,
                ex.down_scale,
                offs=offs,
                out_dtype=dtype,
                use_fast_accum=True,
            )
        )
        mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        xb = x[order // TOPK]
        row["bf16_gate_up_gemm_ms"] = time_ms(lambda _: mm(xb, gate_up.transpose(-2, -1), offs=offs))
    for key in [k for k in row if k.endswith("_ms") and not k.endswith("gemm_ms")]:
        row[key.replace("_ms", "_tflops")] = row["flop"] / (row[key] * 1e-3) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=None)
    args = ap.parse_args()
    global H, E, I, DENSE
    if args.quick or not ON_GPU:
        H, E, I = 64, 8, 32
        DENSE = {k: (min(n, 256), min(kk, 128)) for k, (n, kk) in DENSE.items()}
    rows = [int(r) for r in (args.rows or ("16,64" if not ON_GPU else "256,1024,4096,8192")).split(",")]
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    results = []
    for m in rows:
        for r in dense_rows(m, dtype) + [expert_rows(m, dtype)]:
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True
            )
            results.append(r)
        if ON_GPU:
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
