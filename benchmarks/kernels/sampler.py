"""The official sampler's per-step work on [B × 256, V] fp32 logits, per piece and per path:

- torch path (per request, the request's generator): temperature divide in place, fused statistics,
  then softmax + multinomial + renoise draw per request;
- fused path: one `softmax_sample` launch (statistics + Gumbel-max draw + renoise for every request),
  its uniforms from one Philox call per 4 columns (the default) or per column; or the draw by inverse
  CDF (`draw="invcdf"`: no uniforms per logit, one lane's logits read again per row);
- the self-conditioning top-k (k = 64) over the vocabulary: torch.topk on the whole row, a two-stage
  top-k (per vocabulary slice, then over the slices' candidates), and softmax_sample's own (lane
  maxima, then one gathering read).

GPU: python benchmarks/kernels/sampler.py   CPU: python benchmarks/kernels/sampler.py --quick
"""

from __future__ import annotations

import argparse

import _common as C
import torch

from canvasq.kernels.softmax_argmax import _launch, softmax_argmax_launch, softmax_sample
from canvasq.kernels.softmax_topk import TOP_K_CAP, top_k_scaled


def torch_path(logits: torch.Tensor, temps: torch.Tensor, gens: list[torch.Generator]) -> None:
    B, Cv, V = logits.shape
    logits.div_(temps[:, None, None])
    softmax_argmax_launch(logits.view(-1, V)) if logits.is_cuda else None
    for b in range(B):
        probs = torch.softmax(logits[b], dim=-1, dtype=torch.float32)
        torch.multinomial(probs, 1, generator=gens[b])
        torch.randint(0, V, (Cv,), generator=gens[b], device=logits.device)


def topk_two_stage(logits: torch.Tensor, k: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, V = logits.shape
    vals, ids = torch.topk(logits.view(R, slices, V // slices), k, dim=-1)
    ids = ids + (torch.arange(slices, device=logits.device) * (V // slices))[None, :, None]
    v2, pick = torch.topk(vals.view(R, -1), k, dim=-1)
    return v2, torch.gather(ids.view(R, -1), 1, pick)


# the gather's block and warps (each iteration of its loop ends in a reduction over the block: at 2,048
# columns and 8 warps the loop is latency-bound, not bandwidth-bound)
SWEEP = [(2048, 8), (1024, 1), (512, 1), (256, 1)]


def _top_k_pieces(flat: torch.Tensor, inv, seeds, Cv: int) -> dict:
    """The top-64's parts after the statistics pass (which keeps the lane maxima): all of
    `top_k_scaled`, its threshold (torch.topk over the lane maxima), its final torch.topk over the
    candidate slots; and the whole draw + top-64 over bf16-rounded logits of scale 1 (ties at the top,
    as a random-weight model's head writes them)."""
    lm = _launch(flat, inv.float(), seeds, Cv, 2048, lane_max=True, invcdf=True)[5]
    slots = torch.randn(flat.shape[0], TOP_K_CAP, device=flat.device)
    tied = (flat / 4).bfloat16().float()
    ref = top_k_scaled(flat, inv, Cv, 64, lm)
    sweep = {}
    for bv, w in SWEEP:
        same = all(torch.equal(a, b) for a, b in zip(ref, top_k_scaled(flat, inv, Cv, 64, lm, bv, None, w)))
        name = f"top_k_scaled, gather block {bv}, {w} warps{'' if same else ' (DIFFERS)'}"
        sweep[name] = lambda bv=bv, w=w: top_k_scaled(flat, inv, Cv, 64, lm, block_v=bv, num_warps=w)
    return {
        **sweep,
        "top-64 after the statistics pass (top_k_scaled)": lambda: top_k_scaled(flat, inv, Cv, 64, lm),
        "top-64 threshold (torch.topk over lane maxima)": lambda: torch.topk(lm, 64, dim=-1),
        "top-64 final torch.topk over 512 slots": lambda: torch.topk(slots, 64, dim=-1),
        "fused + top-64, inverse-CDF, bf16-rounded scale-1 logits": lambda: softmax_sample(
            tied, inv, seeds, Cv, top_k=64, draw="invcdf"
        ),
    }


def _arms(logits: torch.Tensor, temps, gens, inv, seeds) -> dict:
    _, Cv, V = logits.shape
    flat = logits.view(-1, V)
    return {
        "torch draws (per request)": lambda: torch_path(logits.clone(), temps, gens),
        "clone (subtract from the torch arm)": lambda: logits.clone(),
        "fused softmax_sample": lambda: softmax_sample(flat, inv, seeds, Cv),
        "fused softmax_sample, Philox per column": lambda: softmax_sample(flat, inv, seeds, Cv, rand4=False),
        "fused softmax_sample + top-64": lambda: softmax_sample(flat, inv, seeds, Cv, top_k=64),
        "fused softmax_sample, inverse-CDF draw": lambda: softmax_sample(flat, inv, seeds, Cv, draw="invcdf"),
        "fused softmax_sample + top-64, inverse-CDF draw": lambda: softmax_sample(
            flat, inv, seeds, Cv, top_k=64, draw="invcdf"
        ),
        **_top_k_pieces(flat, inv, seeds, Cv),
        "topk 64 (torch, whole row)": lambda: torch.topk(flat, 64, dim=-1),
        "topk 64 (two-stage, 32 slices)": lambda: topk_two_stage(flat, 64, 32),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="16,32,64")
    a = ap.parse_args()
    Cv, V = (8, 4096) if a.quick else (256, 262144)
    batches = [2] if a.quick else [int(x) for x in a.batches.split(",")]
    bw = C.measured_bandwidth_gbs(nbytes=(2 << 30) if C.ON_GPU else (8 << 20))
    rows = []
    for B in batches:
        logits = torch.randn(B, Cv, V, device=C.DEVICE) * 4
        temps = torch.full((B,), 0.6, device=C.DEVICE)
        gens = [torch.Generator(device=C.DEVICE).manual_seed(b) for b in range(B)]
        seeds = torch.arange(B, dtype=torch.long, device=C.DEVICE) * 7919
        inv = 1.0 / temps
        flat = logits.view(-1, V)
        v1, _ = torch.topk(flat, 64, dim=-1)
        v2, _ = topk_two_stage(flat, 64, 32)
        v3 = softmax_sample(flat, torch.ones_like(inv), seeds, Cv, top_k=64).top_vals
        same_topk = torch.equal(v1, v2) and torch.equal(v1, v3)
        arms = _arms(logits, temps, gens, inv, seeds)
        for name, fn in arms.items():
            ms = C.time_ms(lambda i, fn=fn: fn())
            nbytes = flat.numel() * 4
            rows.append(
                {
                    "batch": B,
                    "rows": B * Cv,
                    "arm": name,
                    "ms": ms,
                    "GBs_logits_once": nbytes / ms / 1e6,
                    "topk_equal": same_topk,
                }
            )
        del logits, flat, arms
        if C.ON_GPU:
            torch.cuda.empty_cache()
    C.report(
        "sampler",
        rows,
        ["batch", "rows", "arm", "ms", "GBs_logits_once", "topk_equal"],
        {**C.device_info(), "measured_bw_GBs": bw},
    )


if __name__ == "__main__":
    main()
