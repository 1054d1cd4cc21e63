"""The dense MLP's gated activation, gelu_tanh(gate) * up, in one launch over the fused gate/up GEMM
output [N, 2*Id] (HF: a GELU kernel, then a multiply, over two column halves).

Numerics: torch's tanh-GELU on CUDA is 0.5 * x * (1 + tanhf(kBeta * (x + kKappa * x^3))) in fp32,
rounded to the model dtype, then the product with `up` is rounded again; the kernel computes the
same expression in the same order, with the contraction nvcc applies (x + kKappa * x^3 as one FMA,
which LLVM forms too), so on the GPU it reproduces torch's values (tests/kernels/test_gelu_mul.py
checks bit equality there).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, interpreted, pdl_kwargs
from ._math import pdl_enter, tanh

K_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi), as torch spells it
K_KAPPA = 0.044715


@triton.jit
def _gelu_mul_kernel(
    gu_ptr,
    y_ptr,
    R,
    I,
    stride_g,
    k_beta,
    k_kappa,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[r, i] = round(round(gelu_tanh(gu[r, i])) * gu[r, I + i])."""
    pdl_enter(PDL)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (rows[:, None] < R) & (cols[None, :] < I)
    g = tl.load(gu_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows[:, None] * stride_g + (cols[None, :] + I), mask=m, other=0.0).to(tl.float32)
    inner = k_beta * (g + k_kappa * (g * g * g))
    act = (0.5 * g * (1.0 + tanh(inner, INTERPRETED))).to(DT).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * I + cols[None, :], (act * u).to(DT), mask=m)


def gelu_mul_launch(gu: torch.Tensor) -> torch.Tensor:
    n, two_i = gu.shape
    assert two_i % 2 == 0 and gu.stride(-1) == 1, gu.shape
    inter = two_i // 2
    y = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
    block_i = min(1024, triton.next_power_of_2(inter))
    block_r = max(1, min(16, 2048 // block_i))
    if n:
        _gelu_mul_kernel[(triton.cdiv(n, block_r), triton.cdiv(inter, block_i))](
            gu,
            y,
            n,
            inter,
            gu.stride(0),
            K_BETA,
            K_KAPPA,
            BLOCK_R=block_r,
            BLOCK_I=block_i,
            INTERPRETED=interpreted(_gelu_mul_kernel),
            **pdl_kwargs(gu, _gelu_mul_kernel),
            num_warps=4,
        )
    return y


def gelu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """Twin (HF's MLP): gate and up are the two column halves; act(gate) * up in the model dtype."""
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def gelu_mul(gu: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """gu [N, 2*Id] (gate columns, then up) -> gelu_tanh(gate) * up [N, Id]."""
    if impl == "auto":
        impl = "triton" if auto_triton(gu, _gelu_mul_kernel) else "torch"
    if impl == "triton":
        return gelu_mul_launch(gu)
    if impl == "torch":
        return gelu_mul_reference(gu)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """gelu(gate) * up over 1,024-column blocks (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "gelu_mul",
        _gelu_mul_kernel,
        {"BLOCK_R": 2, "BLOCK_I": 1024, "INTERPRETED": False},
        types={"k_beta": "fp32", "k_kappa": "fp32"},
        divisible=frozenset({"gu_ptr", "y_ptr", "stride_g"}),
        rounds_like_hf=True,
    )
