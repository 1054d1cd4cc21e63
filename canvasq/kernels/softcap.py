"""The LM head's epilogue: fp32 logits with the final soft cap, `cap * tanh(x / cap)`, in one pass.

HF (and the runtime's twin) casts the [N, V] head output to fp32 and caps it in place: four passes over
the largest activation of a forward (at the real shape, 256 rows x 262,144 vocab: 0.27 GB of fp32
per pass, about 0.5 ms on an H200). The kernel reads the head output once and writes fp32 once.

Numerics: torch on CUDA divides by a Python scalar as a multiply by its fp32 reciprocal, and its
tanh is CUDA's tanhf; the kernel does the same (x * (1/cap), libdevice tanh, times cap), compiled
without floating-point contraction, so on the GPU it reproduces the twin.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, interpreted, pdl_kwargs
from ._math import NO_FP_FUSION, pdl_enter, tanh


@triton.jit
def _softcap_kernel(
    x_ptr, y_ptr, n, inv_cap, cap, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr
):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    z = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) * inv_cap
    tl.store(y_ptr + offs, tanh(z, INTERPRETED) * cap, mask=m)


@triton.jit
def softcap_on_read(l, inv_cap, cap, INTERPRETED: tl.constexpr):
    """The soft cap inside another kernel, on fp32 values it has just read (`_softcap_kernel`'s math):
    no capped copy is written; -inf (masked lanes) stays -inf."""
    return tl.where(l > float("-inf"), tanh(l * inv_cap, INTERPRETED) * cap, l)


def cap_args(cap: float | None) -> tuple[float, float]:
    """(1 / cap, cap) as the kernels take them (the fp32 reciprocal torch's CUDA division uses), or
    (0, 0) without a cap."""
    return (float(np.float32(1.0) / np.float32(cap)), float(cap)) if cap else (0.0, 0.0)


def softcap_launch(x: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    x = x.contiguous()
    y = _dest(x, out)
    n = x.numel()
    block = 4096
    if n:
        _softcap_kernel[(triton.cdiv(n, block),)](
            x,
            y,
            n,
            *cap_args(cap),
            BLOCK=block,
            INTERPRETED=interpreted(_softcap_kernel),
            **pdl_kwargs(x, _softcap_kernel),
            num_warps=8,
            **NO_FP_FUSION,
        )
    return y


def softcap_reference(x: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Twin (HF's order): fp32 copy, then divide, tanh, multiply in place."""
    y = x.float() if out is None else _dest(x, out).copy_(x)
    return y.div_(cap).tanh_().mul_(cap)


def _dest(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The fp32 result tensor: a new one, or the caller's buffer (its leading elements, viewed as x's
    shape; a CUDA graph writes every captured forward's logits into one shared buffer)."""
    if out is None:
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.dtype != torch.float32 or out.numel() < x.numel() or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 buffer of at least {x.numel()} elements")
    return out.view(-1)[: x.numel()].view(x.shape)


def softcap_logits(
    x: torch.Tensor, cap: float | None, impl: str = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., V] any float dtype -> fp32 logits, soft-capped when `cap` is set; written into `out`
    (a contiguous fp32 buffer with room for x) when it is given."""
    if not cap:
        return x.float() if out is None else _dest(x, out).copy_(x)
    if impl == "auto":
        impl = "triton" if auto_triton(x, _softcap_kernel) else "torch"
    if impl == "triton":
        return softcap_launch(x, cap, out)
    if impl == "torch":
        return softcap_reference(x, cap, out)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """The LM head's softcap over bf16 logits into fp32 (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "softcap",
        _softcap_kernel,
        {"BLOCK": 4096, "INTERPRETED": False},
        types={"y_ptr": "*fp32", "inv_cap": "fp32", "cap": "fp32"},
        divisible=frozenset({"x_ptr", "y_ptr"}),
        num_warps=8,
        options=NO_FP_FUSION,
    )
