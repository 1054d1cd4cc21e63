"""GPU probe (2026-11-30, session 7): the Gluon W4 MoE kernels (`canvasq/kernels/moe/gluon_w4.py`)
against the production Triton ones, GPU-side, at the real shape (E=128, H=2816, I=704, top-8, bf16,
random-normal weights and routing, torch seed 0). Timing: `benchmarks/kernels/_common.time_ms`
(an event pair around each of 50 calls queued back to back, one synchronise, median); every arm's
output checked against the first (Triton, tuned config) arm's within 2e-2, else "WRONG".

    python benchmarks/probes/moe_gluon_gpu_timing.py 256,8       # H200; writes $OUT/gluon_timing.json
"""

import json
import os
import sys
from functools import partial

import torch

from canvasq.kernels.moe import align_routing, pack_w4
from canvasq.kernels.moe.launch import (
    MoeLaunchConfig,
    get_config,
    gluon_tiles,
    launch_down,
    launch_down_gluon,
    launch_gate_up,
    launch_gate_up_gluon,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from _common import time_ms  # noqa: E402


def compare(arms, out, n_rows):
    row, ref = {}, None
    for name, fn in arms.items():
        out.zero_()
        fn()
        got = out[:n_rows].float().clone()
        ref = got if ref is None else ref
        ok = torch.allclose(got, ref, rtol=2e-2, atol=2e-2)
        row[name] = round(time_ms(lambda _: fn()) * 1e3, 1) if ok else f"WRONG {float((got - ref).abs().max()):.3g}"
    return row


def main():
    rows = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256").split(",")]
    E, H, I, K = 128, 2816, 704, 8
    dt, dev = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dt)
    down = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dt)
    p = pack_w4(gate_up, down)
    del gate_up, down
    gluon_tiles(p)
    res = {}
    for T in rows:
        x = torch.randn(T, H, device=dev, dtype=dt)
        ids = torch.topk(torch.randn(T, E, device=dev), K, -1).indices
        tuned = get_config(T, K, p, dt)
        for bm in (16, 32):
            m = align_routing(ids, E, bm)
            n_real = int(m.num_padded.item())
            h = torch.zeros(m.sorted_ids.numel(), I, device=dev, dtype=dt)
            y = torch.zeros(T * K, H, device=dev, dtype=dt)
            base = MoeLaunchConfig(**{**tuned.__dict__, "block_m": bm})
            arms = {"triton": partial(launch_gate_up, x, p, m, base, h)}
            for w in (4, 2, 1):
                cfg = MoeLaunchConfig(block_m=bm, gluon=True, gluon_gate_up_warps=w)
                arms[f"gluon w{w}"] = partial(launch_gate_up_gluon, x, p, m, cfg, h)
            res[f"T{T} bm{bm} gate_up"] = compare(arms, h, n_real)
            launch_gate_up(x, p, m, base, h)  # down's input
            arms = {"triton": partial(launch_down, h, p, m, base, y)}
            for w, t in ((4, 1), (4, 2), (4, 4), (2, 2), (2, 4), (8, 1)):
                cfg = MoeLaunchConfig(block_m=bm, gluon=True, gluon_down_warps=w, gluon_down_tiles=t)
                arms[f"gluon w{w} t{t}"] = partial(launch_down_gluon, h, p, m, cfg, y)
            res[f"T{T} bm{bm} down"] = compare(arms, y, T * K)
            for k in (f"T{T} bm{bm} gate_up", f"T{T} bm{bm} down"):
                print(k, res[k], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_timing.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
