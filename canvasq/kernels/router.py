"""The MoE router's selection in one launch: softmax over the experts in fp32, then the top k.

HF's router (and the torch twin) runs `softmax(logits, dtype=float32)` and `torch.topk`, which on CUDA
is three kernels per layer (softmax, a radix select, a bitonic sort of the k survivors): about 15 us per
layer at 256 rows on the H200, 0.45 ms of a 30-layer forward (torch profile of the forward). Here
one program takes BLOCK_R rows whole (E <= 1024 experts fit in registers), so the selection is k
passes of an arg-max over a row that is already on chip.

Outputs as `torch.topk`'s: probabilities in descending order, fp32 [N, k], and expert ids int64 [N, k].
Ties (equal probabilities) go to the lower expert id. Numerics: exp(x - max) / sum in fp32 like torch's
softmax; Triton's exp may differ from CUDA's expf by an ulp or two, so the probabilities agree to
about 1e-6 relative and the chosen set differs only where two experts' probabilities are that close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, pdl_kwargs
from ._math import pdl_enter


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    p_ptr,
    ids_ptr,
    N,
    E,
    stride_l,
    TOP_K: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, E_P2)
    src = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read the last one (stores are masked)
    x = tl.load(
        logits_ptr + src[:, None] * stride_l + cols[None, :], mask=cols[None, :] < E, other=float("-inf")
    )
    x = x.to(tl.float32)
    mx = tl.max(x, axis=1)
    ex = tl.exp(x - mx[:, None])  # padding columns: exp(-inf) = 0
    p = ex / tl.sum(ex, axis=1)[:, None]
    p = tl.where(cols[None, :] < E, p, -1.0)  # padding never wins
    out = rows.to(tl.int64) * TOP_K
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        # lowest column holding the maximum (ties -> lower expert id)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], E_P2), axis=1)
        tl.store(p_ptr + out + j, best, mask=rows < N)
        tl.store(ids_ptr + out + j, idx.to(tl.int64), mask=rows < N)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)


def router_topk_launch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, e = logits.shape
    assert logits.stride(-1) == 1 and 0 < k <= e <= 1024, (logits.shape, k)
    p = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    e_p2 = triton.next_power_of_2(e)
    block_r = max(1, min(8, 1024 // e_p2))  # 8 rows of 128 experts: 32 programs at 256 rows
    if n:
        _router_topk_kernel[(triton.cdiv(n, block_r),)](
            logits,
            p,
            ids,
            n,
            e,
            logits.stride(0),
            TOP_K=k,
            E_P2=e_p2,
            BLOCK_R=block_r,
            **pdl_kwargs(logits, _router_topk_kernel),
            num_warps=4,
        )
    return p, ids


def router_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin (HF's router): fp32 softmax over the experts, then `torch.topk` (values descending)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.topk(probs, k=k, dim=-1)


def router_topk(logits: torch.Tensor, k: int, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (top-k probabilities fp32 [N, k] descending, expert ids int64 [N, k])."""
    if impl == "auto":
        impl = "triton" if auto_triton(logits, _router_topk_kernel) else "torch"
    if impl == "triton":
        return router_topk_launch(logits, k)
    if impl == "torch":
        return router_topk_reference(logits, k)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """128 experts, top-8, bf16 logits, as `router_topk_launch` launches them
    (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "router_topk",
        _router_topk_kernel,
        {"TOP_K": 8, "E_P2": 128, "BLOCK_R": 8},
        types={"p_ptr": "*fp32", "ids_ptr": "*i64"},
        divisible=frozenset({"logits_ptr", "p_ptr", "ids_ptr", "stride_l"}),
    )
