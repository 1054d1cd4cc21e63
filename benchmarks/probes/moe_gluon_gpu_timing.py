"""GPU probe: the Gluon W4 MoE kernels (`canvasq/kernels/moe/gluon_w4.py`) against the Triton ones,
GPU-side, at the real shape (E=128, H=2816, I=704, top-8, bf16, random-normal weights and routing,
torch seed 0). Timing: `benchmarks/kernels/_common.time_ms` (median); every arm's output checked
against the first (Triton, tuned config) arm's within 2e-2, else "WRONG".

    python benchmarks/probes/moe_gluon_gpu_timing.py 8,16,256     # H200; $OUT/gluon_timing.json
    python benchmarks/probes/moe_gluon_gpu_timing.py --quick      # GPU only: 8 rows, two tiles each

For each row count and each routing block BLOCK_M in BLOCK_MS: the checked-in Triton tiles at that BLOCK_M
(on the K-contiguous pack; the reference arm) and the Gluon tiles below (on the tiled pack,
`W4Experts.to_tiled`); the BLOCK_M with the fastest gate_up + down and its fastest Gluon tiles are
written into the tuned configs (`gluon_block_m`), saved to $OUT under the configs' file name (copy it to
canvasq/kernels/moe/configs/ to keep it). A CUDA worker's packs are tiled, so the Gluon tiles are what
runs; the Triton column says what the K-contiguous path (CANVASQ_MOE_LAYOUT=kcontig) gets.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from canvasq.kernels.moe import align_routing, pack_w4
from canvasq.kernels.moe.config import config_file_name, get_config, save_configs
from canvasq.kernels.moe.launch import launch_matmul

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from _common import time_ms


def compare(arms, out, n_rows):
    row, ref = {}, None
    for name, fn in arms.items():
        out.zero_()
        try:
            fn()
        except (OutOfResources, CompilationError) as ex:  # a tile too big for this BLOCK_M
            row[name] = f"ERR {type(ex).__name__}"
            continue
        got = out[:n_rows].float().clone()
        ref = got if ref is None else ref
        ok = torch.allclose(got, ref, rtol=2e-2, atol=2e-2)
        row[name] = (
            round(time_ms(lambda _, f=fn: f()) * 1e3, 1)
            if ok
            else f"WRONG {float((got - ref).abs().max()):.3g}"
        )
    return row


# (warps, row tiles, stages): 16 * warps * tiles rows must divide I = 704 (gate_up) / H = 2816 (down)
GATE_UP_TILES = (
    (4, 1, 0),
    (2, 2, 0),
    (1, 1, 0),
    (4, 1, 3),
    (4, 1, 4),
    (2, 2, 3),
    (2, 1, 3),
    (1, 4, 3),
)
DOWN_TILES = (
    (4, 1, 0),
    (4, 2, 0),
    (2, 2, 0),
    (8, 1, 0),
    (4, 1, 3),
    (4, 2, 3),
    (4, 2, 4),
    (2, 2, 3),
    (8, 1, 3),
)


# (warps, row tiles, stages, register cap): the best tiles under a register cap (more programs per
# SM; ptxas spills what does not fit)
GATE_UP_CAPPED = ((4, 1, 3, 96), (4, 1, 4, 96), (4, 1, 3, 80), (2, 1, 3, 96), (2, 1, 3, 80))
DOWN_CAPPED = ((4, 2, 3, 72), (4, 2, 3, 64), (2, 2, 3, 96), (4, 1, 0, 64), (2, 2, 0, 96))

# the Gluon kernels' routing block (64 only from 512 rows); BLOCK_MS=16 in the environment: only that one
BLOCK_MS = tuple(int(v) for v in os.environ.get("BLOCK_MS", "16,32,64").split(","))


def _pick(which: str, warps: int, tiles: int, stages: int, maxnreg: int | None = None) -> dict:
    return {
        f"gluon_{which}_warps": warps,
        f"gluon_{which}_tiles": tiles,
        f"gluon_{which}_stages": stages,
        f"gluon_{which}_maxnreg": maxnreg,
    }


def _arm(name: str) -> dict:
    """ "gluon w4 t1 s3 [r96]" -> its _pick arguments."""
    parts = name.split()
    w, t, st = (int(v[1:]) for v in parts[1:4])
    return {"warps": w, "tiles": t, "stages": st, "maxnreg": int(parts[4][1:]) if len(parts) > 4 else None}


def best(row: dict) -> tuple[str, float]:
    """The fastest Gluon tile (the Triton arm is the reference, not a choice)."""
    timed = {k: v for k, v in row.items() if isinstance(v, float) and k != "triton"}
    k = min(timed, key=timed.get)
    return k, timed[k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="?", default="256")
    ap.add_argument("--quick", action="store_true", help="8 rows, BLOCK_M 16, two tiles per matmul")
    a = ap.parse_args()
    rows = [8] if a.quick else [int(v) for v in a.rows.split(",")]
    block_ms = (16,) if a.quick else BLOCK_MS
    gate_up_tiles = GATE_UP_TILES[:2] if a.quick else GATE_UP_TILES + GATE_UP_CAPPED
    down_tiles = DOWN_TILES[:2] if a.quick else DOWN_TILES + DOWN_CAPPED
    E, H, I, K = 128, 2816, 704, 8
    dt, dev = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dt)
    down = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dt)
    p = pack_w4(gate_up, down)
    del gate_up, down
    pt = p.to_tiled()
    res, configs = {}, {}
    for T in rows:
        x = torch.randn(T, H, device=dev, dtype=dt)
        ids = torch.topk(torch.randn(T, E, device=dev), K, -1).indices
        tuned = get_config(T, K, p, dt)
        y = torch.zeros(T * K, H, device=dev, dtype=dt)
        choice = {}  # block_m -> (gate_up + down us, gate_up arm, down arm)
        for bm in [b for b in block_ms if b < 64 or T >= 512]:
            tri = replace(tuned, block_m=bm)  # the Triton arm: the reference (its tiles tuned at block_m)
            m = align_routing(ids, E, bm)
            n_real = int(m.num_padded.item())
            h = torch.zeros(m.sorted_ids.numel(), I, device=dev, dtype=dt)
            arms = {"triton": partial(launch_matmul, "gate_up", x, p, m, tri, h)}
            for w, t, s, *r in gate_up_tiles:
                cfg = replace(tri, **_pick("gate_up", w, t, s, *r))
                arms[f"gluon w{w} t{t} s{s}" + (f" r{r[0]}" if r else "")] = partial(
                    launch_matmul, "gate_up", x, pt, m, cfg, h
                )
            gu = res[f"T{T} m{bm} gate_up"] = compare(arms, h, n_real)
            launch_matmul("gate_up", x, p, m, tri, h)  # down's input
            arms = {"triton": partial(launch_matmul, "down", h, p, m, tri, y)}
            for w, t, s, *r in down_tiles:
                cfg = replace(tri, **_pick("down", w, t, s, *r))
                arms[f"gluon w{w} t{t} s{s}" + (f" r{r[0]}" if r else "")] = partial(
                    launch_matmul, "down", h, pt, m, cfg, y
                )
            dn = res[f"T{T} m{bm} down"] = compare(arms, y, T * K)
            (gu_name, gu_us), (dn_name, dn_us) = best(gu), best(dn)
            choice[bm] = (gu_us + dn_us, gu_name, dn_name)
            for k in (f"T{T} m{bm} gate_up", f"T{T} m{bm} down"):
                print(k, res[k], "->", best(res[k]), flush=True)
        bm = min(choice, key=lambda b: choice[b][0])
        cfg = replace(tuned, gluon_block_m=None if bm == tuned.block_m else bm)
        for which, name in zip(("gate_up", "down"), choice[bm][1:]):
            cfg = replace(cfg, **_pick(which, **_arm(name)))
        configs[T] = cfg
        print(f"T{T}: Gluon BLOCK_M {bm}, {choice[bm][0]:.1f} us per layer", flush=True)
    wrong = [(k, n) for k, r in res.items() for n, v in r.items() if str(v).startswith("WRONG")]
    assert not wrong, wrong
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gluon_timing.json"), "w") as f:
        json.dump(res, f, indent=1)
    name = config_file_name(E, H, I, K, dt, torch.cuda.get_device_name().replace(" ", "_"))
    meta = {"source": "benchmarks/probes/moe_gluon_gpu_timing.py", "commit": os.environ.get("CANVASQ_COMMIT")}
    save_configs(Path(out) / name, configs, meta)
    print("configs with the Gluon choices:", Path(out) / name)


if __name__ == "__main__":
    main()
