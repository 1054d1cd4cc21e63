"""GPU probe: the runtime's attention kernel (`canvasq.kernels.attention`, visibility from `Bounds`) at
several tiles against the masked SDPA call + transposing copy the runtime otherwise makes, at the real
shape: sliding layers (8 KV heads x 256, 2 query heads each, band 1,024) and full layers (2 KV heads x
512, 8 each). A service step: B windows of R rows (one canvas each), each slot with its own committed
context (uniform in [CTX/4, CTX], torch seed 0), the arena read for the longest one (L = the context
rounded up to 256, as `Runtime.context_step` does). bf16. Timing: `_common.time_ms` (an event pair per
call); PDL off. Every arm checked against SDPA first (2e-2 relative, rows that see something).

    python benchmarks/probes/attention_gpu_timing.py --windows 32 --rows 256 --ctx 2048   # H200
    python benchmarks/probes/attention_gpu_timing.py --quick   # one small case, one tile (CPU: interpreted)
"""

import argparse
import json
import os
import sys
from functools import partial

os.environ["CANVASQ_PDL"] = "off"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.kernels.attention import Bounds, attend_launch, attend_reference, tile_smem

DT = torch.bfloat16 if C.ON_GPU else torch.float16  # the interpreter's bf16 loads are wrong

# candidates by head dim (the runtime's table: `canvasq.kernels.attention.TILES`)
TILES: dict[int, tuple[tuple[int, ...], ...]] = {
    256: ((64, 32, 4, 2), (64, 32, 4, 3), (64, 16, 4, 3), (128, 32, 8, 2), (32, 32, 4, 2)),
    512: ((32, 32, 4, 2), (32, 32, 4, 3), (16, 32, 4, 2), (64, 32, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2)),
}
SMEM = 232_448  # an H200 block's shared memory (the quick CPU run skips no tile)


def geometry(nb: int, r: int, ctx: int, band: int | None):
    """Positions, ends and row bounds of nb one-canvas windows over ragged contexts."""
    committed = torch.randint(ctx // 4, ctx + 1, (nb,))
    lmax = -(-(int(committed.max()) + r) // 256) * 256
    pos = torch.arange(lmax + 64).repeat(nb, 1).to(C.DEVICE)  # entries in position order, as appended
    ends = (committed + r).to(C.DEVICE)
    hi = (committed + r)[:, None].expand(nb, r).contiguous().to(C.DEVICE)
    lo = None if band is None else (committed - (band - 1))[:, None].expand(nb, r).contiguous().to(C.DEVICE)
    slots = torch.arange(nb, device=C.DEVICE)
    return slots, pos, Bounds.build(pos, pos[:, :lmax], ends, hi, lo), lmax


def case(nb: int, r: int, ctx: int, kvh: int, g: int, d: int, band: int | None, tiles) -> dict:
    torch.manual_seed(0)
    slots, pos, bounds, lmax = geometry(nb, r, ctx, band)
    q = torch.randn(nb, kvh, g * r, d, device=C.DEVICE, dtype=DT)
    k, v = (torch.randn(nb, kvh, lmax + 64, d, device=C.DEVICE, dtype=DT) for _ in range(2))
    mask = bounds.mask(pos[:, :lmax], g, DT)
    sdpa = partial(attend_reference, q, k, v, slots, lmax, mask, groups=g, first=0)
    want = sdpa().float()
    row: dict = {"L": lmax, "sdpa + copy": round(C.time_ms(lambda _: sdpa()) * 1e3, 1)}
    for t in tiles:
        if tile_smem(d, t) > SMEM:
            continue
        fn = partial(attend_launch, q, k, v, slots, lmax, bounds, groups=g, tiles=t)
        try:
            err = float((fn().float() - want).abs().max() / want.abs().max())
        except Exception as ex:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            row[str(t)] = type(ex).__name__
            continue
        row[str(t)] = round(C.time_ms(lambda _, f=fn: f()) * 1e3, 1) if err < 2e-2 else f"WRONG {err:.3g}"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", default="32", help="windows per call, comma-separated")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=2048, help="largest committed context")
    ap.add_argument("--quick", action="store_true", help="2 windows of 8 rows, 1 KV head x 64, one tile")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument(
        "--tiles",
        default="",
        help='more candidates, as "256:128x32x8x2,64x64x4x2/512:64x32x8x2" (head dim: BMxBNxWxS)',
    )
    a = ap.parse_args()
    if a.quick:
        cases, windows, rows, ctx = (("sliding", 1, 2, 64, 16),), [2], 8, 40
    else:
        cases = (("sliding", 8, 2, 256, 1024), ("full", 2, 8, 512, None))
        windows, rows, ctx = [int(w) for w in a.windows.split(",")], a.rows, a.ctx
    for item in filter(None, a.tiles.split("/")):
        d, spec = item.split(":")
        TILES[int(d)] = TILES.get(int(d), ()) + tuple(
            tuple(int(x) for x in t.split("x")) for t in spec.split(",")
        )
    out = []
    for nb in windows:
        for name, kvh, g, d, band in cases:
            row = case(nb, rows, ctx, kvh, g, d, band, [(16, 32, 4, 2)] if a.quick else TILES[d])
            out.append({"windows": nb, "rows": rows, "ctx": ctx, "layer": name, "us": row})
            print(
                f"B{nb} R{rows} ctx{ctx} {name}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True
            )
            assert not any(str(v).startswith("WRONG") for v in row.values()), row
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
