"""Self-conditioning's expected embedding over the previous step's top k: out[r] = Σ_j p[r, j] ·
table[ids[r, j]] for R rows of k ids and weights, read straight from the embedding table (no
[R, k, H] gather is stored). torch's twin is `F.embedding_bag(mode="sum", per_sample_weights=p)`.

One program per (row, column block): the row's k ids and weights, a [k, BLOCK_H] tile of the table's
rows, an fp32 weighted sum over k, rounded once to the table's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import auto_triton

BLOCK_H = 128  # columns per program: a [k, 128] tile (k = 64: 8,192 elements in registers)


@triton.jit
def _soft_embed_kernel(
    ids_ptr,
    p_ptr,
    table_ptr,
    out_ptr,
    H,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    ids = tl.load(ids_ptr + row * K + ks, mask=kmask, other=0).to(tl.int64)
    w = tl.load(p_ptr + row * K + ks, mask=kmask, other=0.0).to(tl.float32)
    m = kmask[:, None] & (cols[None, :] < H)
    tile = tl.load(table_ptr + ids[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
    acc = tl.sum(tile * w[:, None], axis=0)
    tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def soft_embed_launch(ids: torch.Tensor, p: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    R, K = ids.shape
    H = table.shape[1]
    assert p.shape == (R, K) and table.stride(1) == 1 and table.stride(0) == H
    ids, p = ids.contiguous(), p.contiguous()
    out = torch.empty(R, H, dtype=table.dtype, device=table.device)
    if R:
        grid = (R, triton.cdiv(H, BLOCK_H))
        _soft_embed_kernel[grid](
            ids, p, table, out, H, K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_H=BLOCK_H, num_warps=4
        )
    return out


def soft_embed_reference(ids: torch.Tensor, p: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Twin: torch's weighted embedding bag."""
    return F.embedding_bag(ids, table, per_sample_weights=p, mode="sum")


def soft_embed(ids: torch.Tensor, p: torch.Tensor, table: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """ids [R, k] long, p [R, k] (the table's dtype), table [V, H] -> [R, H]. `impl` "torch"
    (`F.embedding_bag`), "triton" or "auto"; the runtime passes its `sc_bag` (Triton on a GPU)."""
    if impl == "auto":
        impl = "triton" if auto_triton(table, _soft_embed_kernel) else "torch"
    if impl == "triton":
        return soft_embed_launch(ids, p, table)
    if impl == "torch":
        return soft_embed_reference(ids, p, table)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """The top-64 bag at the real width (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "soft_embed",
        _soft_embed_kernel,
        {"K": 64, "BLOCK_K": 64, "BLOCK_H": BLOCK_H},
        types={"p_ptr": "*bf16", "table_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64"},
        divisible=frozenset({"table_ptr", "out_ptr", "H"}),
    )
