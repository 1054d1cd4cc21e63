"""Fused QKV projection: after the LoRA merge, q/k/v weights are concatenated once so attention does one
GEMM (cuBLAS; a Triton GEMM would not beat it at these shapes) instead of three launches.

Letters: T rows, H hidden, Nq/Nk/Nv output widths (heads x head_dim). DiffusionGemma's full-attention
layers have no v_proj (V = K): pass `v_weight=None` and `v` comes back as `None`.
Bytes: one read of x [T, H] instead of two or three, one weight read of (Nq + Nk + Nv) x H.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch


@dataclass(frozen=True)
class FusedQKV:
    weight: torch.Tensor  # [Nq + Nk + Nv, H]
    bias: torch.Tensor | None  # [Nq + Nk + Nv] or None
    splits: tuple[int, int, int]  # (Nq, Nk, Nv); Nv == 0 when the layer has no v_proj


def fuse_qkv_weights(
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor | None = None,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    v_bias: torch.Tensor | None = None,
) -> FusedQKV:
    """Concatenate (already LoRA-merged) projection weights [N*, H] into one [ΣN, H] matrix."""
    ws = [q_weight, k_weight] + ([v_weight] if v_weight is not None else [])
    H = q_weight.shape[1]
    assert all(w.dim() == 2 and w.shape[1] == H for w in ws)
    assert len({w.dtype for w in ws}) == 1 and len({w.device for w in ws}) == 1
    biases = [q_bias, k_bias] + ([v_bias] if v_weight is not None else [])
    has_bias = [b is not None for b in biases]
    assert all(has_bias) or not any(has_bias), "either every projection has a bias or none does"
    bias = torch.cat([b for b in biases if b is not None]) if all(has_bias) else None
    nv = v_weight.shape[0] if v_weight is not None else 0
    return FusedQKV(torch.cat(ws).contiguous(), bias, (q_weight.shape[0], k_weight.shape[0], nv))


def qkv_proj(x: torch.Tensor, fused: FusedQKV):
    """x [..., H] -> (q [..., Nq], k [..., Nk], v [..., Nv] or None), views into one GEMM output."""
    y = torch.nn.functional.linear(x, fused.weight, fused.bias)
    nq, nk, nv = fused.splits
    q, k = y[..., :nq], y[..., nq : nq + nk]
    v = y[..., nq + nk : nq + nk + nv] if nv else None
    return q, k, v


def qkv_proj_reference(x, q_weight, k_weight, v_weight=None, q_bias=None, k_bias=None, v_bias=None):
    """Twin: three separate projections."""
    lin = torch.nn.functional.linear
    v = lin(x, v_weight, v_bias) if v_weight is not None else None
    return lin(x, q_weight, q_bias), lin(x, k_weight, k_bias), v


def fuse_attention_module(attn: torch.nn.Module) -> FusedQKV:
    """FusedQKV from an HF attention module's `q_proj`, `k_proj`, optional `v_proj` (nn.Linear each)."""
    # nn.Module's __getattr__ is typed Tensor | Module: the projections are Linear-like (LoRA merged)
    q, k = cast(torch.nn.Linear, attn.q_proj), cast(torch.nn.Linear, attn.k_proj)
    v = cast(torch.nn.Linear | None, getattr(attn, "v_proj", None))
    return fuse_qkv_weights(
        q.weight,
        k.weight,
        v.weight if v is not None else None,
        q.bias,
        k.bias,
        v.bias if v is not None else None,
    )
