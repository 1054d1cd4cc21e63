"""GPU probe (2026-11-30, session 9): the runtime's attention kernel (`canvasq.kernels.attention`) at
several tiles against SDPA + the transposing copy it replaced, at the real shape: sliding layers (8 KV
heads x 256, 2 query heads each) and full layers (2 KV heads x 512, 8 each), one window of R rows over
128 + R arena entries, an additive band mask, bf16, torch seed 0. Timing: 20 calls in one CUDA graph,
replayed 10 times, median / 20; PDL off. Every arm checked against SDPA first (2e-2 relative).

    python benchmarks/probes/attention_gpu_timing.py 256,8     # H200
"""

import os
import sys
from functools import partial

os.environ["CANVASQ_PDL"] = "off"

import torch

from canvasq.kernels.attention import attend_launch, attend_reference

sys.path.insert(0, os.path.dirname(__file__))
from norm_fusion_gpu_timing import time_ms

TILES = (
    (32, 32, 8, 2),
    (32, 32, 4, 2),
    (64, 32, 4, 2),
    (64, 32, 8, 2),
    (64, 64, 4, 2),
    (16, 32, 4, 2),
    (128, 32, 8, 2),
)


def case(R: int, kvh: int, g: int, d: int) -> dict:
    torch.manual_seed(0)
    L = 128 + R
    q = torch.randn(1, kvh, g * R, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, kvh, L + 64, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([1], device="cuda")
    pos = torch.arange(L, device="cuda")
    lo = torch.randint(0, 64, (1, 1, g * R, 1), device="cuda")
    mask = torch.zeros(1, 1, g * R, L, device="cuda").masked_fill(pos < lo, float("-inf")).bfloat16()
    want = attend_reference(q, k, v, slots, L, mask, groups=g)
    row = {
        "sdpa + copy": round(time_ms(lambda _: attend_reference(q, k, v, slots, L, mask, groups=g)) * 1e3, 1)
    }
    for t in TILES:
        if d == 512 and t[0] * d * 2 * (1 + 2 * t[3]) > 200_000:  # q + staged k, v tiles: no room
            continue
        fn = partial(attend_launch, q, k, v, slots, L, mask, groups=g, tiles=t)
        try:
            err = float((fn().float() - want.float()).abs().max() / want.float().abs().max())
        except Exception as ex:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            row[str(t)] = type(ex).__name__
            continue
        row[str(t)] = round(time_ms(lambda _, f=fn: f()) * 1e3, 1) if err < 2e-2 else f"WRONG {err:.3g}"
    return row


def main():
    for R in [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256").split(",")]:
        for name, kvh, g, d in (("sliding", 8, 2, 256), ("full", 2, 8, 512)):
            row = case(R, kvh, g, d)
            print(f"R{R} {name}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
