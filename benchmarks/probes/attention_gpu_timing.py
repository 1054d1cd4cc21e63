"""GPU probe: the runtime's attention kernel (`canvasq.kernels.attention`) at several tiles against SDPA +
the transposing copy it replaces, at the real shape: sliding layers (8 KV heads x 256, 2 query heads
each) and full layers (2 KV heads x 512, 8 each), one window of R rows over 128 + R arena entries, an
additive band mask, bf16, torch seed 0. Timing: `_common.time_ms(graph=True)`; PDL off. Every arm
checked against SDPA first (2e-2 relative).

    python benchmarks/probes/attention_gpu_timing.py 256,8     # H200
    python benchmarks/probes/attention_gpu_timing.py --quick   # one small case, one tile (CPU: interpreted)
"""

import argparse
import os
import sys
from functools import partial

os.environ["CANVASQ_PDL"] = "off"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.kernels.attention import attend_launch, attend_reference

DT = torch.bfloat16 if C.ON_GPU else torch.float16  # the interpreter's bf16 loads are wrong


def time_ms(fn) -> float:
    return C.time_ms(fn, graph=True)


TILES = (
    (32, 32, 8, 2),
    (32, 32, 4, 2),
    (64, 32, 4, 2),
    (64, 32, 8, 2),
    (64, 64, 4, 2),
    (16, 32, 4, 2),
    (128, 32, 8, 2),
)


def case(R: int, kvh: int, g: int, d: int, tiles=TILES) -> dict:
    torch.manual_seed(0)
    L = 128 + R
    q = torch.randn(1, kvh, g * R, d, device=C.DEVICE, dtype=DT)
    k, v = (torch.randn(2, kvh, L + 64, d, device=C.DEVICE, dtype=DT) for _ in range(2))
    slots = torch.tensor([1], device=C.DEVICE)
    pos = torch.arange(L, device=C.DEVICE)
    lo = torch.randint(0, 64, (1, 1, g * R, 1), device=C.DEVICE)
    mask = torch.zeros(1, 1, g * R, L, device=C.DEVICE).masked_fill(pos < lo, float("-inf")).to(DT)
    want = attend_reference(q, k, v, slots, L, mask, groups=g)
    row = {
        "sdpa + copy": round(time_ms(lambda _: attend_reference(q, k, v, slots, L, mask, groups=g)) * 1e3, 1)
    }
    for t in tiles:
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="?", default="256")
    ap.add_argument("--quick", action="store_true", help="8 rows, 1 KV head x 64, the first tile")
    a = ap.parse_args()
    cases = (("sliding", 1, 2, 64),) if a.quick else (("sliding", 8, 2, 256), ("full", 2, 8, 512))
    for R in [8] if a.quick else [int(v) for v in a.rows.split(",")]:
        for name, kvh, g, d in cases:
            row = case(R, kvh, g, d, TILES[:1] if a.quick else TILES)
            print(f"R{R} {name}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
            assert not any(str(v).startswith("WRONG") for v in row.values()), row


if __name__ == "__main__":
    main()
