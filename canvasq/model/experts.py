"""Routed experts in torch: the reference twins the runtime runs when not on the W4 kernels.

Legend: N rows, K experts per row, E experts, H hidden, I expert width. Both functions take
x [N, H], topk_ids [N, K], topk_w [N, K] (fp32), gate_up [E, 2I, H], down [E, H, I] (HF's expert
layout) and return [N, H] in x's dtype; each row's K weighted expert outputs are summed in fp32 in a
fixed order (HF's grouped_mm combine, no atomics), so reruns are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Routed experts, torch reference. x: [N, H]; topk_ids: [N, K]; topk_w: [N, K] fp32;
    gate_up: [E, 2I, H]; down: [E, H, I] -> [N, H] in x's dtype.

    Assignments sorted by expert, one (gate_up, down) matmul pair per expert hit, then each token's K
    outputs summed in fixed k order in fp32 (no index_add: reruns are bit-identical). Bytes moved:
    every hit expert's weights once (all E of them once N*K >~ 4E).
    """
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x[order // k]
    out = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        seg = xs[start : start + c]
        g, u = F.linear(seg, gate_up[e]).chunk(2, dim=-1)
        out[start : start + c] = F.linear(gelu_tanh(g) * u, down[e])
        start += c
    y = torch.empty_like(out)
    y[order] = out
    y = y.view(n, k, -1).float() * topk_w[..., None].float()
    return y.sum(1).to(x.dtype)  # fixed-order reduction over k (no atomics): bit-identical reruns


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return _grouped_mm_fn() is not None


def moe_grouped(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """`moe_reference` with the per-expert loop replaced by two grouped GEMMs (torch's grouped_mm,
    the kernel HF's default `grouped_mm` experts use): no host sync, one launch per matmul."""
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.arange(1, gate_up.shape[0] + 1, device=flat.device)
    offs = torch.searchsorted(sorted_e, bounds, right=False).to(torch.int32)  # sync-free (no bincount)
    xs = x[order // k]
    mm = _grouped_mm_fn()
    g, u = mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    out = mm((gelu_tanh(g) * u).contiguous(), down.transpose(-2, -1), offs=offs)  # [N*K, H]
    y = torch.empty_like(out)
    y[order] = out
    y = y.view(n, k, -1).float() * topk_w[..., None].float()
    return y.sum(1).to(x.dtype)  # fixed-order reduction over k (no atomics): bit-identical reruns
