"""GPU probe (2026-11-30, kept because BENCHMARKS.md cites it): current W4 MoE kernels vs a K-contiguous
layout with swap-AB at the real shape, T=256; `python benchmarks/probes/moe_kc_swapab_probe.py` (H200).
Result: no variant beat the current kernels by more than noise (raw: results/h200_2026-11-30_moe_kc_swapab_probe.json).
Ran on the first packing (q [E, Kp/2, N]); since the K-contiguous packing (session 6) it no longer describes
the current kernels and is not maintained."""

import itertools
import json
import os
import sys

sys.path.insert(0, "benchmarks/kernels")
sys.path.insert(0, "benchmarks/probes")
import _common as C
import moe_kc_swapab_kernels as KX
import torch
import triton

from canvasq.kernels.moe import align_routing
from canvasq.kernels.moe.launch import MoeLaunchConfig, get_config, launch_down, launch_gate_up
from canvasq.kernels.moe.quant import W4Config, W4Experts

torch.manual_seed(0)
E, H, I, K = 128, 2816, 704, 8
dev, dt = "cuda", torch.bfloat16


def rnd_packed():
    gq = torch.randint(0, 256, (E, H // 2, 2 * I), dtype=torch.uint8, device=dev)
    gs = (torch.rand(E, H // 128, 2 * I, device=dev) * 0.01 + 0.001).to(dt)
    gz = torch.randint(0, 16, (E, H // 128, 2 * I), device=dev).to(dt)
    dq = torch.randint(0, 256, (E, I // 2, H), dtype=torch.uint8, device=dev)
    ds = (torch.rand(E, I // 64, H, device=dev) * 0.01 + 0.001).to(dt)
    dz = torch.randint(0, 16, (E, I // 64, H), device=dev).to(dt)
    return W4Experts(gq, gs, gz, dq, ds, dz, hidden=H, inter=I, config=W4Config())


packed = rnd_packed()
gq_t = packed.gate_up_q.transpose(1, 2).contiguous()  # [E, 2I, H/2]
dq_t = packed.down_q.transpose(1, 2).contiguous()  # [E, H, I/2]
wbytes_gu = sum(
    t.numel() * t.element_size() for t in (packed.gate_up_q, packed.gate_up_scale, packed.gate_up_zero)
)
wbytes_dn = sum(t.numel() * t.element_size() for t in (packed.down_q, packed.down_scale, packed.down_zero))
bw = C.measured_bandwidth_gbs()
res = {"bw_GBps": bw}
for T in (256,):
    R = 3
    xs = [torch.randn(T, H, device=dev, dtype=dt) for _ in range(R)]
    ids = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]) for _ in range(R)]
    base_cfg = get_config(T, K, packed, dt)
    for bm in (16,):
        cfg = MoeLaunchConfig(**{**base_cfg.__dict__, "block_m": bm})
        metas = [align_routing(i, E, bm) for i in ids]
        P = metas[0].sorted_ids.numel()
        h = [torch.zeros(P, I, device=dev, dtype=dt) for _ in range(R)]
        launch_gate_up(xs[0], packed, metas[0], cfg, h[0])
        href = h[0].clone()
        t_cur = C.time_ms(lambda i: launch_gate_up(xs[i], packed, metas[i], cfg, h[i]), 30, 3, R)
        y = torch.zeros(T * K, H, device=dev, dtype=dt)
        launch_down(href, packed, metas[0], cfg, y)
        yref = y.clone()
        t_cur_d = C.time_ms(lambda i: launch_down(h[i], packed, metas[i], cfg, y), 30, 3, R)
        res[f"T{T}_bm{bm}_current"] = {"gate_up": t_cur, "down": t_cur_d}
        print(T, bm, "current", round(t_cur, 4), round(t_cur_d, 4), flush=True)
        n_real = int(metas[0].num_padded.item())
        for swap, bn, w, st in itertools.product((1, 0), (64, 128), (4, 8), (3, 4)):

            def gu(i):
                m = metas[i]
                KX.gate_up_kc[(P // bm, triton.cdiv(I, bn))](
                    xs[i],
                    gq_t,
                    packed.gate_up_scale,
                    packed.gate_up_zero,
                    h[i],
                    m.sorted_ids,
                    m.block_expert,
                    m.num_padded,
                    m.num_assign,
                    K,
                    H,
                    I,
                    xs[i].stride(0),
                    gq_t.stride(0),
                    gq_t.stride(1),
                    packed.gate_up_scale.stride(0),
                    packed.gate_up_scale.stride(1),
                    h[i].stride(0),
                    GROUP=128,
                    NUM_GROUPS=H // 128,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    SWAP=swap,
                    num_warps=w,
                    num_stages=st,
                )

            def dn(i, hh=None):
                m = metas[i]
                KX.down_kc[(P // bm, triton.cdiv(H, bn))](
                    hh if hh is not None else h[i],
                    dq_t,
                    packed.down_scale,
                    packed.down_zero,
                    y,
                    m.sorted_ids,
                    m.block_expert,
                    m.num_padded,
                    m.num_assign,
                    H,
                    I,
                    h[i].stride(0),
                    dq_t.stride(0),
                    dq_t.stride(1),
                    packed.down_scale.stride(0),
                    packed.down_scale.stride(1),
                    y.stride(0),
                    GROUP=64,
                    NUM_GROUPS=I // 64,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    num_warps=w,
                    num_stages=st,
                )

            out = {}
            try:
                h[0].zero_()
                gu(0)
                ok = torch.allclose(h[0][:n_real].float(), href[:n_real].float(), rtol=2e-2, atol=2e-2)
                out["gate_up"] = C.time_ms(gu, 30, 3, R) if ok else float("nan")
            except Exception as ex:
                out["gate_up_err"] = type(ex).__name__
            try:
                y.zero_()
                dn(0, href)
                ok = torch.allclose(y.float(), yref.float(), rtol=2e-2, atol=2e-2)
                out["down"] = C.time_ms(dn, 30, 3, R) if ok else float("nan")
            except Exception as ex:
                out["down_err"] = type(ex).__name__
            res[f"T{T}_bm{bm}_kc_swap{swap}_bn{bn}_w{w}_s{st}"] = out
            print(T, bm, "swap", swap, bn, w, st, out, flush=True)
res["bytes"] = {"gate_up": wbytes_gu, "down": wbytes_dn}
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
