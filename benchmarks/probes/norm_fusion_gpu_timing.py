"""GPU probe (2026-11-30, session 9): the layer's fused launches against the ones they replace, at the
real shape (hidden 2816, 16 query / 8 KV heads x 256 on a sliding layer, top-8 of 128 experts, bf16,
random inputs, torch seed 0), rows 256 and 8. Timing: each arm captured 20 times in one CUDA
graph, the graph replayed 10 times between CUDA events, median / 20 (queued from Python one by one,
these launches leave the GPU idle: host-bound); PDL off (CANVASQ_PDL=off is set here), so a kernel's
time is its own, not its wait on the one before. Outputs checked equal first.

- end of layer: `add_rms_norm` fed the experts' uncombined rows (`ExpertRows`, one launch) against
  `combine_rows` then `add_rms_norm` (two), at 4 / 8 / 16 warps for the fused one;
- attention: `qkv_norm_rope` (one launch) against three `rms_norm_rope` launches.

    python benchmarks/probes/norm_fusion_gpu_timing.py 256,8     # H200
"""

import os
import sys

os.environ["CANVASQ_PDL"] = "off"

import torch

from canvasq.kernels.moe.launch import ExpertRows, combine_rows
from canvasq.kernels.norm_fused import (
    Scatter,
    add_rms_norm_launch,
    qkv_norm_rope_launch,
    rms_norm_rope_launch,
)


def time_ms(fn, n: int = 20, reps: int = 10) -> float:
    """ms per call of `fn(0)`, n calls captured in one CUDA graph, median over reps replays."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn(0)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[reps // 2]


def end_of_layer(T, D=2816, K=8, E=128, dt=torch.bfloat16):
    m, res = (torch.randn(T, D, device="cuda", dtype=dt) for _ in range(2))
    y_tk = torch.randn(T * K, D, device="cuda", dtype=dt)
    ids = torch.topk(torch.randn(T, E, device="cuda"), K, -1).indices
    rows = ExpertRows(
        y_tk, torch.rand(T, K, device="cuda") + 0.1, ids, torch.rand(E, device="cuda", dtype=dt) + 0.5
    )
    w, w1, w2 = (torch.rand(D, device="cuda", dtype=dt) + 0.5 for _ in range(3))
    scale = torch.tensor([0.7], device="cuda", dtype=dt)
    sep = lambda _: add_rms_norm_launch(m, w, res, combine_rows(rows), scale, pre=(w1, w2))
    fused = lambda _: add_rms_norm_launch(m, w, res, rows, scale, pre=(w1, w2))
    assert torch.equal(sep(0), fused(0))
    out = {"combine + add_rms_norm": time_ms(sep) * 1e3, "add_rms_norm(ExpertRows)": time_ms(fused) * 1e3}
    out["combine alone"] = time_ms(lambda _: combine_rows(rows)) * 1e3
    e = combine_rows(rows)
    out["add_rms_norm alone"] = (
        time_ms(lambda _: add_rms_norm_launch(m, w, res, e, scale, pre=(w1, w2))) * 1e3
    )
    return out


def qkv(T, hq=16, hk=8, d=256, dt=torch.bfloat16):
    x = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=dt)
    q, k, v = (t.view(T, -1, d) for t in x.split([hq * d, hk * d, hk * d], dim=1))
    wq, wk = (torch.rand(d, device="cuda", dtype=dt) + 0.5 for _ in range(2))
    pos = torch.arange(T, device="cuda").float()[:, None] * (
        1e-4 ** torch.linspace(0, 1, d // 2, device="cuda")
    )
    cos, sin = (f(torch.cat([pos, pos], -1)).to(dt) for f in (torch.cos, torch.sin))
    a, b = torch.zeros(T, dtype=torch.long, device="cuda"), torch.arange(T, device="cuda")
    tq = Scatter(torch.zeros(1, hq, T, d, device="cuda", dtype=dt), a, b)
    tk, tv = (Scatter(torch.zeros(1, hk, T + 128, d, device="cuda", dtype=dt), a, b) for _ in range(2))

    def three(_):
        rms_norm_rope_launch(k, wk, cos, sin, 1e-6, tk)
        rms_norm_rope_launch(v, None, None, None, 1e-6, tv)
        rms_norm_rope_launch(q, wq, cos, sin, 1e-6, tq)

    one = lambda _: qkv_norm_rope_launch(q, k, v, wq, wk, cos, sin, 1e-6, tq, tk, tv)
    three(0)
    want = [t.dst.clone() for t in (tq, tk, tv)]
    one(0)
    assert all(torch.equal(t.dst, w_) for t, w_ in zip((tq, tk, tv), want))
    return {"3 x rms_norm_rope": time_ms(three) * 1e3, "qkv_norm_rope": time_ms(one) * 1e3}


def main():
    for T in [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256").split(",")]:
        torch.manual_seed(0)
        for name, res in (("end of layer", end_of_layer(T)), ("q/k/v norms", qkv(T))):
            print(f"T{T} {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
