"""GPU probe (2026-11-30, session 6): the current W4 MoE kernels against `moe_asm_kc_kernels` (K-contiguous
packing, nibbles dequantised on 32-bit words by inline PTX) at the real shape; each candidate's output is
checked against the current kernels' before it is timed. `python benchmarks/probes/moe_asm_kc_probe.py`
(H200; writes $OUT/asm_probe.json).
Ran at commit 5a08c5f on the first packing (q [E, Kp/2, N], transposed here for the probe kernels); the
probe kernels became the production ones with the K-contiguous packing, so at later commits both arms
read the transposed bytes as if they were the other layout: not maintained."""

import itertools
import json
import os
import sys

sys.path.insert(0, "benchmarks/kernels")
sys.path.insert(0, "benchmarks/probes")
import _common as C
import moe_asm_kc_kernels as KX
import torch
import triton

from canvasq.kernels.moe import align_routing
from canvasq.kernels.moe.launch import MoeLaunchConfig, get_config, launch_down, launch_gate_up
from canvasq.kernels.moe.quant import W4Config, W4Experts

torch.manual_seed(0)
E, H, I, K = 128, 2816, 704, 8
dev, dt = "cuda", torch.bfloat16
ROWS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256,8").split(",")]


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
nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
wb_gu = nbytes(packed.gate_up_q, packed.gate_up_scale, packed.gate_up_zero)
wb_dn = nbytes(packed.down_q, packed.down_scale, packed.down_zero)
bw = C.measured_bandwidth_gbs()
res = {"bw_GBps": bw, "bytes": {"gate_up": wb_gu, "down": wb_dn}}
print("bandwidth GB/s", round(bw), flush=True)
R = 3
for T in ROWS:
    xs = [torch.randn(T, H, device=dev, dtype=dt) for _ in range(R)]
    ids = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]) for _ in range(R)]
    base = get_config(T, K, packed, dt)
    for bm in (16, 32):
        cfg = MoeLaunchConfig(**{**base.__dict__, "block_m": bm})
        metas = [align_routing(i, E, bm) for i in ids]
        P = metas[0].sorted_ids.numel()
        n_real = int(metas[0].num_padded.item())
        h = [torch.zeros(P, I, device=dev, dtype=dt) for _ in range(R)]
        launch_gate_up(xs[0], packed, metas[0], cfg, h[0])
        href = h[0].clone()
        y = torch.zeros(T * K, H, device=dev, dtype=dt)
        launch_down(href, packed, metas[0], cfg, y)
        yref = y.clone()
        cur = {
            "gate_up": C.time_ms(lambda i: launch_gate_up(xs[i], packed, metas[i], cfg, h[i]), 40, 5, R),
            "down": C.time_ms(lambda i: launch_down(h[i], packed, metas[i], cfg, y), 40, 5, R),
        }
        res[f"T{T}_bm{bm}_current"] = cur
        print(T, bm, "current", cur, flush=True)

        def gu(i, bn, w, st, fold):
            m = metas[i]
            KX.gate_up_asm[(P // bm, triton.cdiv(I, bn))](
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
                FOLD=fold,
                num_warps=w,
                num_stages=st,
            )

        def dn(i, bn, w, st, fold, hh=None):
            m = metas[i]
            KX.down_asm[(P // bm, triton.cdiv(H, bn))](
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
                FOLD=fold,
                num_warps=w,
                num_stages=st,
            )

        best = {}
        for kind, bns in (("gate_up", (32, 64, 128)), ("down", (64, 128, 256))):
            for bn, w, st, fold in itertools.product(bns, (4, 8), (2, 3, 4), (0, 1)):
                if fold and (w, st) != (4, 3):
                    continue
                key = f"T{T}_bm{bm}_{kind}_bn{bn}_w{w}_s{st}_f{fold}"
                try:
                    if kind == "gate_up":
                        h[0].zero_()
                        gu(0, bn, w, st, fold)
                        ok = torch.allclose(
                            h[0][:n_real].float(), href[:n_real].float(), rtol=2e-2, atol=2e-2
                        )
                        t = C.time_ms(lambda i: gu(i, bn, w, st, fold), 40, 5, R) if ok else float("nan")
                    else:
                        y.zero_()
                        dn(0, bn, w, st, fold, href)
                        ok = torch.allclose(y.float(), yref.float(), rtol=2e-2, atol=2e-2)
                        t = C.time_ms(lambda i: dn(i, bn, w, st, fold), 40, 5, R) if ok else float("nan")
                except Exception as ex:  # a tile too big for this device
                    res[key] = type(ex).__name__
                    continue
                res[key] = t
                if t == t and t < best.get(kind, (float("inf"),))[0]:
                    best[kind] = (t, key)
        res[f"T{T}_bm{bm}_best"] = best
        print(T, bm, "best", best, flush=True)
        for kind, wb in (("gate_up", wb_gu), ("down", wb_dn)):
            if kind in best:
                print(
                    f"  {kind}: {best[kind][0] * 1e3:.0f} us = {wb / best[kind][0] / 1e6 / bw:.1%} of bw "
                    f"(current {cur[kind] * 1e3:.0f} us = {wb / cur[kind] / 1e6 / bw:.1%})",
                    flush=True,
                )
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "asm_probe.json"), "w"), indent=1)
