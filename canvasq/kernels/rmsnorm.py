"""Fused RMSNorm, DiffusionGemma style: y = x * (mean(x^2) + eps)^-1/2 * weight, computed in fp32.

HF's `DiffusionGemmaRMSNorm` multiplies by `weight` itself (initialised to ones, not Gemma 2/3's
`1 + weight`), and has a `with_scale=False` variant (the V norm) with no weight at all: pass
`weight=None`. x [..., D] any float dtype -> same shape and dtype. One program normalises BLOCK_R rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, pdl_kwargs
from ._math import pdl_enter
from .fp8_quant import quant_outputs, quant_tile_store


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    R,
    D,
    stride_x,
    stride_y,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    """QUANT: the rows rounded to y's dtype go out quantised per row (e4m3 q, fp32 scale; `fp8_quant`),
    y is not written."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D + eps
    y = x * (1.0 / tl.sqrt(ms))[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if QUANT:
        quant_tile_store(y.to(y_ptr.dtype.element_ty).to(tl.float32), q_ptr, s_ptr, rows64, cols, mask, R, D)
    else:
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None = None,
    quant: bool = False,
):
    """The kernel on x [..., D]; `quant`: (q [R, D] e4m3, scale [R]) of the normed rows instead of them."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    if weight is not None:
        assert weight.shape == (D,) and weight.is_contiguous() and weight.device == x.device
    y = x2 if quant else (out if out is not None else torch.empty_like(x2))
    y = y.view(R, D)
    q, s = quant_outputs(R, D, x.device) if quant else (y, y)
    assert y.stride(-1) == 1
    block_d = triton.next_power_of_2(D)
    assert block_d <= 65536, f"row width {D} too wide for one tile"
    block_r = max(1, min(16, 4096 // block_d, triton.next_power_of_2(R)))
    if R:
        _rms_norm_kernel[(triton.cdiv(R, block_r),)](
            x2,
            weight if weight is not None else x2,
            y,
            q,
            s,
            R,
            D,
            x2.stride(0),
            y.stride(0),
            float(eps),
            HAS_WEIGHT=weight is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            QUANT=quant,
            **pdl_kwargs(x2, _rms_norm_kernel),
            num_warps=4 if block_d * block_r <= 4096 else 8,
        )
    return (q, s) if quant else y.view(x.shape)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> the normed rows quantised per row, (q [R, D] e4m3, scale [R] fp32), in one launch:
    what `fp8_quant.quantize_rows_triton(rms_norm(x, weight))` gives (CUDA only)."""
    q, s = rms_norm_launch(x, weight, eps, quant=True)
    return q, s


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Twin: HF's formula. Bytes: reads x and weight, writes y (2 * numel * itemsize)."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, impl: str = "auto"
) -> torch.Tensor:
    """x [..., D], weight [D] or None (with_scale=False) -> [..., D] in x.dtype."""
    if impl == "auto":
        impl = "triton" if auto_triton(x, _rms_norm_kernel) else "torch"
    if impl == "triton":
        return rms_norm_launch(x, weight, eps)
    if impl == "torch":
        return rms_norm_reference(x, weight, eps)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """One hidden-width row per program (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    for quant in (False, True):  # quantised: the input of the FP8 q/k/v projection
        yield CompileSpec(
            "rms_norm" + ("_quant" if quant else ""),
            _rms_norm_kernel,
            {"HAS_WEIGHT": True, "BLOCK_R": 1, "BLOCK_D": 4096, "QUANT": quant},
            types={"eps": "fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
            divisible=frozenset({"x_ptr", "w_ptr", "y_ptr", "q_ptr", "D", "stride_x", "stride_y"}),
            num_warps=8,
        )
