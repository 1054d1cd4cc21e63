"""GPU probe (2026-11-30, session 6; kept because BENCHMARKS.md cites its output): the W4 MoE kernels of
the first packing (q [E, Kp/2, N], byte-wise operand loads) against the production ones (q [E, N, Kp/2],
PTX dequantisation), GPU-side: 50 launches back to back between two events, median of 5, same weights and
routing for both, each output checked against the first arm's. The old kernels come from git history:

    git show 5a08c5f:canvasq/kernels/moe/kernels.py > /tmp/old_kernels.py
    python benchmarks/probes/moe_layout_gpu_timing.py /tmp/old_kernels.py 256,8      # H200; $OUT/kt.json

(Raw: results/h200_2026-11-30_s6_moe_old_vs_new_gpu_timing.json. It came from the uncommitted script
this file was written from: the same arms, tiles and timing, the "new" arm at 184bdca (before EVEN_K),
plus a third arm with 5a08c5f's probe kernels, which became the production ones. This committed form
has not itself run on a GPU. The probe's first timing, synchronised per call, is
results/h200_2026-11-30_s6_asm_probe_synced_timing.json, from benchmarks/probes/moe_asm_kc_probe.py at
5a08c5f.)"""

import importlib.util
import json
import os
import sys
from functools import partial

import torch
import triton

from canvasq.kernels.moe import align_routing, pack_w4
from canvasq.kernels.moe.launch import MoeLaunchConfig, launch_down, launch_gate_up

spec = importlib.util.spec_from_file_location("old_kernels", sys.argv[1])
OK = importlib.util.module_from_spec(spec)
spec.loader.exec_module(OK)
ROWS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "256").split(",")]
E, H, I, K = 128, 2816, 704, 8
dt, dev = torch.bfloat16, "cuda"
OLD_FLAGS = {
    "DOT_PREC": "tf32",
    "DEQUANT": 2,
    "SCALE_IN_TILE": False,
    "FOLD_ZERO": False,
    "PREFETCH_SCALE": False,
}

torch.manual_seed(0)
gate_up = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(dt)
down = (torch.randn(E, H, I, device=dev) * I**-0.5).to(dt)
p = pack_w4(gate_up, down)
del gate_up, down
gq_old = p.gate_up_q.transpose(1, 2).contiguous()  # [E, H/2, 2I]: the first layout's bytes
dq_old = p.down_q.transpose(1, 2).contiguous()


def gpu_ms(fn, n=50, reps=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / n)
    return sorted(out)[len(out) // 2]


def compare(arms, out, n_rows):
    """{arm: µs} with every arm's output checked against the first's ("WRONG" otherwise)."""
    row, ref = {}, None
    for name, fn in arms.items():
        out.zero_()
        fn()
        got = out[:n_rows].float().clone()
        ref = got if ref is None else ref
        row[name] = round(gpu_ms(fn) * 1e3, 1) if torch.allclose(got, ref, rtol=2e-2, atol=2e-2) else "WRONG"
    return row


def old_gate_up(x, m, h, bm, bn, w, st):
    meta = (m.sorted_ids, m.block_expert, m.num_padded, m.num_assign)
    strides = (x.stride(0), gq_old.stride(0), gq_old.stride(1), p.gate_up_scale.stride(0),
               p.gate_up_scale.stride(1), h.stride(0))  # fmt: skip
    OK._w4_gate_up_kernel[(m.sorted_ids.numel() // bm, triton.cdiv(I, bn))](
        x, gq_old, p.gate_up_scale, p.gate_up_zero, h, *meta, K, H, I, *strides, GROUP=128,
        NUM_GROUPS=H // 128, BLOCK_M=bm, BLOCK_N=bn, SUB=64, num_warps=w, num_stages=st, **OLD_FLAGS,
    )  # fmt: skip


def old_down(h, m, y, bm, bn, w, st):
    meta = (m.sorted_ids, m.block_expert, m.num_padded, m.num_assign)
    strides = (h.stride(0), dq_old.stride(0), dq_old.stride(1), p.down_scale.stride(0),
               p.down_scale.stride(1), y.stride(0))  # fmt: skip
    OK._w4_down_kernel[(m.sorted_ids.numel() // bm, triton.cdiv(H, bn))](
        h, dq_old, p.down_scale, p.down_zero, y, *meta, H, I, *strides, GROUP=64,
        NUM_GROUPS=I // 64, BLOCK_M=bm, BLOCK_N=bn, SUB=32, num_warps=w, num_stages=st, **OLD_FLAGS,
    )  # fmt: skip


res = {}
for T in ROWS:
    x = torch.randn(T, H, device=dev, dtype=dt)
    ids = torch.topk(torch.randn(T, E, device=dev), K, -1).indices
    for bm in (16, 32):
        m = align_routing(ids, E, bm)
        n_real = int(m.num_padded.item())
        h = torch.zeros(m.sorted_ids.numel(), I, device=dev, dtype=dt)
        y = torch.zeros(T * K, H, device=dev, dtype=dt)
        for bn, w, st in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3), (32, 4, 3)):
            cfg = MoeLaunchConfig(block_m=bm, gate_up_block_n=bn, gate_up_warps=w, gate_up_stages=st)
            arms = {
                "old": partial(old_gate_up, x, m, h, bm, bn, w, st),
                "new": partial(launch_gate_up, x, p, m, cfg, h),
            }
            res[f"T{T} bm{bm} gate_up bn{bn} w{w} s{st}"] = compare(arms, h, n_real)
        launch_gate_up(x, p, m, MoeLaunchConfig(block_m=bm), h)  # down's input
        for bn, w, st in ((256, 4, 3), (256, 4, 4), (128, 4, 3), (128, 8, 3), (64, 4, 3)):
            cfg = MoeLaunchConfig(block_m=bm, down_block_n=bn, down_warps=w, down_stages=st)
            arms = {
                "old": partial(old_down, h, m, y, bm, bn, w, st),
                "new": partial(launch_down, h, p, m, cfg, y),
            }
            res[f"T{T} bm{bm} down bn{bn} w{w} s{st}"] = compare(arms, y, T * K)
        for k in [k for k in res if k.startswith(f"T{T} bm{bm} ")]:
            print(k, res[k], flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "kt.json"), "w") as f:
    json.dump(res, f, indent=1)
