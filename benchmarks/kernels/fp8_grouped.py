"""The FP8 experts' grouped GEMMs: torch's `_scaled_grouped_mm` against our Triton kernel
(`kernels.fp8_grouped`) over a sweep of tilings, at the real expert shape (issue 34, item 5).

    python3 benchmarks/kernels/fp8_grouped.py             # Hopper: T = 1024, 4096 tokens, top-8 of 128
    python3 benchmarks/kernels/fp8_grouped.py --quick     # CPU smoke (interpreter, fp32, tiny shapes)

Per token count and GEMM (gate/up: N = 2I, K = H; down: N = H, K = I): rows in expert order from a
uniform top-8 routing (and with `--skew` a routing whose experts are drawn from a Zipf-like law), e4m3
operands with row scales, each arm timed by `triton.testing.do_bench` (median ms, L2 flushed between
calls) and checked against torch's output (the CPU: against the dequantising twin). The plain GEMMs also
run the W4A8 prototype (`kernels.moe.w4a8`) with the same weights W4-packed, against the pack's own
dequantised GEMM; its bias form (`w4a8b_*`) takes each row's group sums computed before the timed
call (on the FP8 path the quantisers write them, `fp8_quant.quantize_rows_sums`). On sm_90 the same
pack reordered (`gluon_pack.tile_q8`) goes through the wgmma kernel (`moe.gluon_w4a8`, `w4a8wg_*`)
at each of its sweep tilings. Labels ending
`mm` launch row tiles outer (`fp8_grouped._tile_of`); `p1`, `p2` persistent launches of that many
programs an SM (`Tiles.persistent`). GB/s count the weights once plus the rows read and written;
TFLOP/s count 2·M·N·K. Rows go to $OUT/fp8_grouped.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import DEVICE, ON_GPU, time_ms
from triton.runtime.errors import OutOfResources

from canvasq.kernels.fp8_grouped import grouped_gemm
from canvasq.kernels.fp8_grouped_tiles import Tiles, gemm_key, save_tuned, tiles_for
from canvasq.kernels.fp8_quant import gelu_mul_quant_triton, quantize_rows_triton
from canvasq.kernels.gelu_mul import gelu_mul_reference
from canvasq.kernels.moe.gluon_w4a8 import SWEEP_TILES
from canvasq.kernels.moe.quant import dequantize_w4, quantize_w4
from canvasq.kernels.moe.w4a8 import W4A8Matrix, group_sums, w4a8_grouped
from canvasq.model.fp8 import _grouped, expert_order, quantize_rows
from canvasq.provenance import git_commit

H, E, TOPK, I = 2816, 128, 8, 704
TOL = 2e-2  # rel_err against the reference that an arm must stay under

# row tiles outer (`_tile_of`) won at every case on an H100 (BENCHMARKS): each tiling that way, and
# two column-outer ones for reference
SWEEP = [
    Tiles(bm, bn, bk, warps, stages, tma=tma, m_major=True)
    for bm, bn, bk, warps, stages, tma in [
        (64, 64, 128, 4, 4, False),
        (64, 128, 128, 4, 3, False),
        (64, 128, 128, 4, 4, False),
        (64, 128, 128, 8, 4, False),
        (64, 256, 128, 4, 3, False),
        (64, 128, 64, 4, 5, False),
        (128, 128, 128, 8, 3, False),
        (128, 128, 128, 8, 4, False),
        (64, 64, 128, 4, 4, True),
        (64, 128, 128, 4, 4, True),
        (64, 256, 128, 4, 3, True),
        (128, 256, 128, 8, 3, True),
        (128, 256, 128, 8, 4, True),
    ]
] + [Tiles(64, 128, 128, 4, 3), Tiles(128, 256, 128, 8, 3, tma=True)]
# persistent launches (`Tiles.persistent`: programs an SM, each looping over tiles, loads pipelined
# across them): the H100's winners at 1,024 tokens (m64 n128, TMA for gate/up, k64 for down) and at
# 4,096 (m128 n256 TMA), at one and two programs an SM
SWEEP += [
    Tiles(bm, bn, bk, warps, stages, tma=tma, m_major=True, persistent=p)
    for bm, bn, bk, warps, stages, tma in [
        (64, 128, 128, 4, 4, True),
        (64, 128, 128, 4, 4, False),
        (64, 128, 64, 4, 5, False),
        (128, 256, 128, 8, 4, True),
    ]
    for p in (1, 2)
]


# the gate/up GEMM with its activation (BLOCK_N: the columns of each half)
GATED = [
    Tiles(64, 64, 128, 4, 4),
    Tiles(64, 64, 128, 4, 4, m_major=True),
    Tiles(128, 128, 128, 8, 3, tma=True, m_major=True),
]


def routing(tokens: int, skew: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(tokens, E, generator=g, device=DEVICE)
    if skew:  # expert e drawn about (e + 1) ** -0.8 as often: a few hot experts, a long tail
        scores = scores.log() / (torch.arange(1, E + 1, device=DEVICE, dtype=torch.float32) ** -0.8)
    return scores.topk(TOPK, dim=1).indices


def case(
    tokens: int, name: str, n: int, k: int, skew: bool, tilings: list[Tiles], seed: int, w4a8: str = "with"
) -> dict:
    """One GEMM at one routing: torch's arm (Hopper), our default tiling and `tilings`. name "gate_up+act"
    times the gate/up GEMM with its activation quantised: torch's GEMM, then `gelu_mul_quant`, against
    our gated epilogue, then the row quantiser (the FP8 expert layer's two paths). `w4a8`: "with" adds
    the W4A8 arms to the plain GEMMs, "skip" leaves them out, "only" times them beside torch's alone."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    ids = routing(tokens, skew, seed)
    _, offs, _ = expert_order(ids, E, kernel=False)
    m = tokens * TOPK
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    aq, a_s = quantize_rows(torch.randn(m, k, generator=g, device=DEVICE, dtype=dtype))
    w = torch.randn(E, n, k, generator=g, device=DEVICE, dtype=dtype) * k**-0.5
    wq, w_s = quantize_rows(w)
    if not ON_GPU:  # the interpreter's dot takes fp32, not e4m3: the same values, widened
        aq, wq = aq.float(), wq.float()
    gated = name.endswith("+act")

    def ours(t: Tiles):
        out = grouped_gemm(aq, a_s, wq, w_s, offs, dtype, t, gated=gated)
        return _dequantized(quantize_rows_triton(out) if ON_GPU else quantize_rows(out)) if gated else out

    def theirs(impl: str = "torch"):  # impl "triton": the product's path for ours (plain GEMM, then act)
        out = _grouped(aq, a_s, wq, w_s, offs, dtype, kernel=ON_GPU or impl == "triton", impl=impl)
        if not gated:
            return out
        return _dequantized(gelu_mul_quant_triton(out) if ON_GPU else quantize_rows(gelu_mul_reference(out)))

    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    row = {"tokens": tokens, "gemm": name, "N": n, "K": k, "skew": skew}
    row |= {"rows_per_expert_max": int(counts.max()), "experts_used": int((counts > 0).sum())}
    ref = theirs()
    arms = {"torch": theirs} if ON_GPU else {}
    default = tiles_for(m, E, n, k, gated, "untuned")
    tiles = {} if w4a8 == "only" else {"default": default} | {_label(t): t for t in tilings}
    for label, t in tiles.items():
        arms[label] = lambda t=t: ours(t)
    if gated and ON_GPU and tiles:  # the plain GEMM at the device's tuned tiling, then `gelu_mul_quant`
        arms["tuned+gelu_mul_quant"] = lambda: theirs("triton")
    nbytes, flop = E * n * k + m * k + 2 * m * n, 2 * m * n * k
    row["arms"] = [_timed(label, fn, ref, nbytes, flop) for label, fn in arms.items()]
    # a tiling whose output is off is never a winner, however fast
    ok = [a for a in row["arms"] if "ms" in a and a["arm"] in tiles and a["rel_err"] < TOL]
    row["best_tiles"] = asdict(tiles[min(ok, key=lambda a: a["ms"])["arm"]]) if ok else None
    if not gated and w4a8 != "skip":
        row["arms"] += w4a8_arms(aq, a_s, w, offs, dtype)
    return row


# block_m, block_n, warps, the bias form, row tiles outer (`kernels.moe.w4a8`)
# the best of nine on an H100, 1.35-2.7x torch's e4m3 GEMM's time on half its bytes (BENCHMARKS)
W4A8 = [(64, 128, 4, True, True)]


def w4a8_arms(aq, a_s, w, offs, dtype) -> list[dict]:
    """The W4A8 prototype on the same rows with the weights W4-packed (the pack's groups: 128 for K
    2,816, 64 for 704), each arm against its own reference (the pack dequantised, the twin's GEMM)."""
    (m, k), (e, n, _) = aq.shape, w.shape
    group = 128 if k % 128 == 0 and k > 1024 else 64 if k % 64 == 0 else 32
    if k % group:
        return []
    q, ws, wz = quantize_w4(w, group, dtype)
    ref = _grouped(
        aq.float(), a_s, dequantize_w4(q, ws, wz, k, torch.float32), a_s.new_ones(e, n), offs, dtype, False
    )
    x = aq if ON_GPU else aq.to(torch.float16)
    nbytes = q.numel() + 2 * ws.numel() * ws.element_size() + m * k + 2 * m * n
    sums = group_sums(x, group)  # the bias form's, outside the timed call (the quantisers' on the FP8 path)
    out = []
    for bm, bn, warps, bias, mm in W4A8 if ON_GPU else [(16, 32, 4, False, False), (16, 32, 4, True, True)]:

        def fn(bm=bm, bn=bn, warps=warps, bias=bias, mm=mm):
            return w4a8_grouped(x, a_s, q, ws, wz, offs, dtype, bm, bn, warps, 3, sums if bias else None, mm)

        label = f"w4a8{'b' if bias else ''}_m{bm}n{bn}w{warps}" + ("mm" if mm else "")
        out.append(_timed(label, fn, ref, nbytes, 2 * m * n * k))
    wg = W4A8Matrix.of(q, ws, wz)  # the product's choice: on sm_90 the pack reordered for wgmma
    for tiles in SWEEP_TILES if wg.wgmma else ():
        arm = replace(wg, tiles=tiles)
        label = "w4a8wg_m{}n{}w{}s{}a{}".format(*tiles)
        out.append(
            _timed(label, lambda arm=arm: arm.gemm(x, a_s, sums, offs, dtype), ref, nbytes, 2 * m * n * k)
        )
    return out


def _dequantized(qs) -> torch.Tensor:
    return qs[0].float() * qs[1][:, None]


def _timed(label: str, fn, ref: torch.Tensor, nbytes: int, flop: int) -> dict:
    try:
        got = fn()
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = time_ms(lambda _: fn())
    except (OutOfResources, RuntimeError) as exc:  # a tiling past the shared memory: recorded
        return {"arm": label, "error": str(exc).splitlines()[0][:200]}
    gbps, tflops = nbytes / (ms * 1e-3) / 1e9, flop / (ms * 1e-3) / 1e12
    return {"arm": label, "ms": ms, "rel_err": err, "GBps": gbps, "TFLOPs": tflops}


def _label(t: Tiles) -> str:
    return (
        f"m{t.block_m}n{t.block_n}k{t.block_k}w{t.warps}s{t.stages}"
        + ("tma" if t.tma else "")
        + ("mm" if t.m_major else "")
        + (f"p{t.persistent}" if t.persistent else "")
    )


def write(out: Path, results: list[dict]) -> None:
    """The raw rows, and the uniform routing's winners as the tuned file the launcher reads."""
    (out / "fp8_grouped.json").write_text(json.dumps(results, indent=1))
    gemms: dict[str, dict[int, Tiles]] = {}
    for r in results:
        if not r["skew"] and r["best_tiles"]:
            key = gemm_key(r["N"], r["K"], r["gemm"].endswith("+act"))
            gemms.setdefault(key, {})[r["tokens"] * TOPK] = Tiles(**r["best_tiles"])
    meta = {"device": torch.cuda.get_device_name() if ON_GPU else "cpu", "commit": git_commit()}
    save_tuned(out / "fp8_grouped_tuned.json", gemms, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", default=None, help="comma list (default 1024,4096; --quick: 24)")
    ap.add_argument("--skew", action="store_true", help="also a skewed routing")
    ap.add_argument("--sweep", choices=("all", "none"), default="all")
    ap.add_argument(
        "--w4a8",
        choices=("with", "skip", "only"),
        default="with",
        help="the W4A8 arms: beside the e4m3 sweep, left out, or alone beside torch's (their own process: "
        "a kernel that faults takes no e4m3 case with it)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    global H, E, I
    tilings, gated = (SWEEP, GATED) if args.sweep == "all" else ([], GATED[:1])
    if args.quick or not ON_GPU:
        H, E, I = 96, 8, 48
        tilings = [Tiles(16, 32, 32, 4, 1, False), Tiles(32, 16, 64, 4, 1), Tiles(16, 32, 32, 4, 1, tma=True)]
        tilings += [Tiles(16, 32, 32, 4, 1, tma=True, m_major=True, persistent=1)]
        gated = [Tiles(16, 16, 32, 4, 1), Tiles(16, 16, 32, 4, 1, tma=True)]
    tokens = [int(t) for t in (args.tokens or ("24" if not ON_GPU else "1024,4096")).split(",")]
    results, correct = [], True
    for t in tokens:
        for skew in (False, True) if args.skew else (False,):
            gemms = (("gate_up", 2 * I, H), ("down", H, I), ("gate_up+act", 2 * I, H))
            for name, n, k in gemms[:2] if args.w4a8 == "only" else gemms:
                r = case(
                    t, name, n, k, skew, gated if name.endswith("+act") else tilings, args.seed, args.w4a8
                )
                ok = [a for a in r["arms"] if "ms" in a]
                # torch and another arm on a GPU; on CPU one arm (none where the W4A8 alone has no group)
                need = 2 if ON_GPU else 0 if args.w4a8 == "only" else 1
                correct &= all(a["rel_err"] < TOL for a in ok) and len(ok) >= need
                best = min((a for a in ok if a["arm"] != "torch"), key=lambda a: a["ms"], default=None)
                best = {"best": best["arm"], "best_ms": round(best["ms"], 4)} if best else {"best": None}
                print(json.dumps({**r, **best}), flush=True)
                results.append(r)
                if os.environ.get("OUT"):  # after each case: a call cut short keeps what it measured
                    write(Path(os.environ["OUT"]), results)
    print(json.dumps({"bench": "fp8_grouped", "device": DEVICE, "correct": correct}))


if __name__ == "__main__":
    main()
