"""The FP8 experts' grouped GEMMs: torch's `_scaled_grouped_mm` against our Triton kernel
(`kernels.fp8_grouped`) over a sweep of tilings, at the real expert shape (issue 34, item 5).

    python3 benchmarks/kernels/fp8_grouped.py             # Hopper: T = 1024, 4096 tokens, top-8 of 128
    python3 benchmarks/kernels/fp8_grouped.py --quick     # CPU smoke (interpreter, fp32, tiny shapes)

Per token count and GEMM (gate/up: N = 2I, K = H; down: N = H, K = I): rows in expert order from a
uniform top-8 routing (and with `--skew` a routing whose experts are drawn from a Zipf-like law), e4m3
operands with row scales, each arm timed by `triton.testing.do_bench` (median ms, L2 flushed between
calls) and checked against torch's output (the CPU: against the dequantising twin). GB/s count the
weights once plus the rows read and written; TFLOP/s count 2·M·N·K. Rows go to $OUT/fp8_grouped.json.
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
from _common import DEVICE, ON_GPU, time_ms
from triton.runtime.errors import OutOfResources

from canvasq.kernels.fp8_grouped import Tiles, grouped_gemm, tiles_for
from canvasq.model.fp8 import _grouped, expert_order, quantize_rows

H, E, TOPK, I = 2816, 128, 8, 704

SWEEP = [
    Tiles(bm, bn, bk, warps, stages, tma=tma)
    for bm, bn, bk, warps, stages, tma in [
        (64, 64, 128, 4, 4, False),
        (64, 128, 128, 4, 3, False),
        (64, 128, 128, 4, 4, False),
        (64, 128, 128, 4, 5, False),
        (64, 128, 128, 8, 4, False),
        (64, 256, 128, 4, 3, False),
        (64, 256, 128, 8, 3, False),
        (64, 128, 256, 4, 3, False),
        (64, 64, 256, 4, 4, False),
        (128, 128, 128, 8, 3, False),
        (128, 128, 128, 8, 4, False),
        (128, 128, 128, 4, 4, False),
        (128, 256, 128, 8, 3, False),
        (128, 64, 128, 4, 4, False),
        (128, 128, 64, 8, 5, False),
        (64, 64, 128, 4, 4, True),
        (64, 128, 128, 4, 3, True),
        (64, 128, 128, 4, 4, True),
        (64, 256, 128, 4, 3, True),
        (64, 256, 128, 8, 3, True),
        (128, 128, 128, 8, 3, True),
        (128, 128, 128, 8, 4, True),
        (128, 256, 128, 8, 3, True),
    ]
]


def routing(tokens: int, skew: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(tokens, E, generator=g, device=DEVICE)
    if skew:  # expert e drawn about (e + 1) ** -0.8 as often: a few hot experts, a long tail
        scores = scores.log() / (torch.arange(1, E + 1, device=DEVICE, dtype=torch.float32) ** -0.8)
    return scores.topk(TOPK, dim=1).indices


def case(tokens: int, name: str, n: int, k: int, skew: bool, tilings: list[Tiles], seed: int) -> dict:
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    ids = routing(tokens, skew, seed)
    _, offs, _ = expert_order(ids, E, kernel=False)
    m = tokens * TOPK
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    aq, a_s = quantize_rows(torch.randn(m, k, generator=g, device=DEVICE, dtype=dtype))
    wq, w_s = quantize_rows(torch.randn(E, n, k, generator=g, device=DEVICE, dtype=dtype) * k**-0.5)
    if not ON_GPU:  # the interpreter's dot takes fp32, not e4m3: the same values, widened
        aq, wq = aq.float(), wq.float()
    ref = _grouped(aq, a_s, wq, w_s, offs, dtype, kernel=ON_GPU)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    row = {
        "tokens": tokens,
        "gemm": name,
        "N": n,
        "K": k,
        "skew": skew,
        "rows_per_expert_max": int(counts.max()),
        "experts_used": int((counts > 0).sum()),
    }
    nbytes = E * n * k + m * k + 2 * m * n
    flop = 2 * m * n * k
    arms = {"torch": None} if ON_GPU else {}
    arms |= {"default": tiles_for(m, E)} | {_label(t): t for t in tilings}
    out = []
    for label, t in arms.items():
        if t is None:
            fn = lambda _: _grouped(aq, a_s, wq, w_s, offs, dtype, kernel=True)
        else:
            fn = lambda _, t=t: grouped_gemm(aq, a_s, wq, w_s, offs, dtype, t)
        try:
            got = fn(0)
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms = time_ms(fn)
        except (OutOfResources, RuntimeError) as exc:  # a tiling past the shared memory: recorded
            out.append({"arm": label, "error": str(exc).splitlines()[0][:200]})
            continue
        out.append(
            {
                "arm": label,
                "ms": ms,
                "rel_err": err,
                "GBps": nbytes / (ms * 1e-3) / 1e9,
                "TFLOPs": flop / (ms * 1e-3) / 1e12,
            }
        )
    row["arms"] = out
    return row


def _label(t: Tiles) -> str:
    return f"m{t.block_m}n{t.block_n}k{t.block_k}w{t.warps}s{t.stages}" + ("tma" if t.tma else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", default=None, help="comma list (default 1024,4096; --quick: 24)")
    ap.add_argument("--skew", action="store_true", help="also a skewed routing")
    ap.add_argument("--sweep", choices=("all", "none"), default="all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    global H, E, I
    tilings = SWEEP if args.sweep == "all" else []
    if args.quick or not ON_GPU:
        H, E, I = 96, 8, 48
        tilings = [Tiles(16, 32, 32, 4, 1, False), Tiles(32, 16, 64, 4, 1)]
    tokens = [int(t) for t in (args.tokens or ("24" if not ON_GPU else "1024,4096")).split(",")]
    results, correct = [], True
    for t in tokens:
        for skew in (False, True) if args.skew else (False,):
            for name, n, k in (("gate_up", 2 * I, H), ("down", H, I)):
                r = case(t, name, n, k, skew, tilings, args.seed)
                ok = [a for a in r["arms"] if "ms" in a]
                correct &= all(a["rel_err"] < 2e-2 for a in ok) and any(a["arm"] == "default" for a in ok)
                best = min((a for a in ok if a["arm"] not in ("torch",)), key=lambda a: a["ms"])
                print(json.dumps({**r, "best": best["arm"], "best_ms": round(best["ms"], 4)}), flush=True)
                results.append(r)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_grouped.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"bench": "fp8_grouped", "device": DEVICE, "correct": correct}))


if __name__ == "__main__":
    main()
