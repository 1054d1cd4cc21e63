"""GPU probe: the layer's fused launches against the ones they replace, at the real shape (hidden
2816, 16 query / 8 KV heads x 256 on a sliding layer, top-8 of 128 experts, bf16, random inputs, torch
seed 0), rows 256 and 8. Timing: `_common.time_ms(graph=True)`, the calls replayed from one CUDA graph
(queued from Python one by one, these launches leave the GPU idle: host-bound); PDL off
(CANVASQ_PDL=off is set here), so a kernel's time is its own, not its wait on the one before.
Outputs checked equal first.

- end of layer: `add_rms_norm` fed the experts' uncombined rows (`ExpertRows`, one launch) against
  `combine_rows` then `add_rms_norm` (two);
- attention: `qkv_norm_rope` (one launch) against three `rms_norm_rope` launches;

    python benchmarks/probes/norm_fusion_gpu_timing.py 256,8     # H200
    python benchmarks/probes/norm_fusion_gpu_timing.py --quick   # CPU: interpreter, fp16, tiny widths
"""

import argparse
import os
import sys

os.environ["CANVASQ_PDL"] = "off"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.kernels.moe.launch import ExpertRows, combine_rows
from canvasq.kernels.norm_residual import add_rms_norm_launch
from canvasq.kernels.norm_rope import Scatter, qkv_norm_rope_launch, rms_norm_rope_launch


def time_ms(fn) -> float:
    return C.time_ms(fn, graph=True)


DT = torch.bfloat16 if C.ON_GPU else torch.float16  # the interpreter's bf16 loads are wrong


def end_of_layer(T, D=2816, K=8, E=128, dt=DT):
    m, res = (torch.randn(T, D, device=C.DEVICE, dtype=dt) for _ in range(2))
    y_tk = torch.randn(T * K, D, device=C.DEVICE, dtype=dt)
    ids = torch.topk(torch.randn(T, E, device=C.DEVICE), K, -1).indices
    rows = ExpertRows(
        y_tk, torch.rand(T, K, device=C.DEVICE) + 0.1, ids, torch.rand(E, device=C.DEVICE, dtype=dt) + 0.5
    )
    w, w1, w2 = (torch.rand(D, device=C.DEVICE, dtype=dt) + 0.5 for _ in range(3))
    scale = torch.tensor([0.7], device=C.DEVICE, dtype=dt)
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


def add_norm_warps(T, warps, D=2816, K=8, E=128, dt=DT, maxnreg=()) -> dict:
    """`add_rms_norm` as a layer calls it, at each `num_warps` of `warps`: the attention's (h + norm(a)),
    and the end of layer's (the experts' uncombined rows combined, three norms, scaled), µs and the
    GB/s of the bytes each must move (its reads and its one write); `maxnreg`: the end of layer's also
    at the first of `warps` with its registers a thread capped at each of these."""
    g = lambda *shape: torch.randn(*shape, device=C.DEVICE, dtype=dt)
    a, h, m = g(T, D), g(T, D), g(T, D)
    ids = torch.topk(torch.randn(T, E, device=C.DEVICE), K, -1).indices
    rows = ExpertRows(
        g(T * K, D),
        torch.rand(T, K, device=C.DEVICE) + 0.1,
        ids,
        torch.rand(E, device=C.DEVICE, dtype=dt) + 0.5,
    )
    w, w1, w2 = (torch.rand(D, device=C.DEVICE, dtype=dt) + 0.5 for _ in range(3))
    scale = torch.tensor([0.7], device=C.DEVICE, dtype=dt)
    size = torch.finfo(dt).bits // 8
    calls = {
        "attention": (lambda nw: add_rms_norm_launch(a, w, h, num_warps=nw), 3 * T * D * size),
        "end of layer": (
            lambda nw: add_rms_norm_launch(m, w, h, rows, scale, pre=(w1, w2), num_warps=nw),
            (3 + K) * T * D * size,
        ),
    }
    out = {}
    for name, (call, moved) in calls.items():
        want = call(None)
        for nw in warps:
            assert torch.equal(call(nw), want) or torch.allclose(call(nw), want, rtol=1e-2, atol=1e-2), nw
            us = time_ms(lambda _, c=call, n=nw: c(n)) * 1e3
            out[f"{name} warps {nw}"] = f"{us:.1f} us {moved / us / 1e3:.0f} GB/s"
    call, moved = calls["end of layer"]
    for cap in maxnreg:
        capped = lambda _, c=cap: add_rms_norm_launch(
            m, w, h, rows, scale, pre=(w1, w2), num_warps=warps[0], maxnreg=c
        )
        assert torch.equal(capped(0), call(warps[0])), cap
        us = time_ms(capped) * 1e3
        out[f"end of layer warps {warps[0]} maxnreg {cap}"] = f"{us:.1f} us {moved / us / 1e3:.0f} GB/s"
    return out


def qkv(T, hq=16, hk=8, d=256, dt=DT):
    x = torch.randn(T, (hq + 2 * hk) * d, device=C.DEVICE, dtype=dt)
    q, k, v = (t.view(T, -1, d) for t in x.split([hq * d, hk * d, hk * d], dim=1))
    wq, wk = (torch.rand(d, device=C.DEVICE, dtype=dt) + 0.5 for _ in range(2))
    pos = torch.arange(T, device=C.DEVICE).float()[:, None] * (
        1e-4 ** torch.linspace(0, 1, d // 2, device=C.DEVICE)
    )
    cos, sin = (f(torch.cat([pos, pos], -1)).to(dt) for f in (torch.cos, torch.sin))
    a, b = torch.zeros(T, dtype=torch.long, device=C.DEVICE), torch.arange(T, device=C.DEVICE)
    tq = Scatter(torch.zeros(1, hq, T, d, device=C.DEVICE, dtype=dt), a, b)
    tk, tv = (Scatter(torch.zeros(1, hk, T + 128, d, device=C.DEVICE, dtype=dt), a, b) for _ in range(2))

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="?", default="256")
    ap.add_argument("--quick", action="store_true", help="8 rows at tiny widths (on CPU: interpreted)")
    ap.add_argument("--warps", default="", help="comma list: add_rms_norm's num_warps to time instead")
    ap.add_argument(
        "--maxnreg", default="", help="comma list: with --warps, the end of layer's register caps"
    )
    a = ap.parse_args()
    if a.warps:
        for T in [int(v) for v in a.rows.split(",")]:
            torch.manual_seed(0)
            kw = {"D": 256, "K": 4, "E": 16} if a.quick else {}
            caps = [int(v) for v in a.maxnreg.split(",") if v]
            res = add_norm_warps(T, [int(v) for v in a.warps.split(",")], maxnreg=caps, **kw)
            print(f"T{T} " + ", ".join(f"{k}: {v}" for k, v in res.items()), flush=True)
        return
    small = {"end": {"D": 256, "K": 4, "E": 16}, "qkv": {"hq": 2, "hk": 1, "d": 64}} if a.quick else None
    for T in [8] if a.quick else [int(v) for v in a.rows.split(",")]:
        torch.manual_seed(0)
        cases = (
            ("end of layer", end_of_layer(T, **(small["end"] if small else {}))),
            ("q/k/v norms", qkv(T, **(small["qkv"] if small else {}))),
        )
        for name, res in cases:
            print(f"T{T} {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)
    if a.quick:  # the warps sweep's path too
        print("T8 " + ", ".join(f"{k}: {v}" for k, v in add_norm_warps(8, [4, 8], D=256, K=4, E=16).items()))


if __name__ == "__main__":
    main()
