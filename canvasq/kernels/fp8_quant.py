"""Per-row FP8 (e4m3) quantisation in one launch: each program loads a row, takes its absolute
maximum, and writes the e4m3 row and its fp32 scale (x ≈ q * scale). `gelu_mul_quant` does the same
on the experts' gated activation gelu_tanh(gate) * up straight from the gate/up GEMM output, so the
model-dtype activation is never written.

Numerics match `canvasq.model.fp8.quantize_rows` (the torch twin): amax in fp32, scale = amax / 448,
x / scale clamped to ±448 and rounded to nearest by the conversion. The fused activation rounds to
the model dtype before the product, as the unfused path does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._math import tanh

E4M3_MAX = 448.0
_K_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
_K_KAPPA = 0.044715


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    dest_ptr,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    COPIES: tl.constexpr,
    SCATTER: tl.constexpr,
):
    # SCATTER: the row's COPIES quantised copies go to output rows dest[row, 0..COPIES)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    if SCATTER:
        for c in tl.static_range(COPIES):
            out = tl.load(dest_ptr + row * COPIES + c)
            tl.store(q_ptr + out * K + cols, q, mask=m)
            tl.store(s_ptr + out, scale)
    else:
        tl.store(q_ptr + row * K + cols, q, mask=m)
        tl.store(s_ptr + row, scale)


@triton.jit
def _gelu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, I, stride_g, k_beta, k_kappa, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < I
    DT: tl.constexpr = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + I + cols, mask=m, other=0.0).to(tl.float32)
    act = (0.5 * g * (1.0 + tanh(k_beta * (g + k_kappa * (g * g * g)), False))).to(DT).to(tl.float32)
    y = (act * u).to(DT).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_ptr + row * I + cols, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row, scale)


def quantize_rows_triton(
    x: torch.Tensor, dest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K] e4m3, scale [M] fp32). With `dest` [M, c] (a
    permutation of the output rows): row i's copies go to rows dest[i] of q [M*c, K] and scale
    [M*c] (the MoE's rows in expert order, without quantising first and gathering after)."""
    m, k = x.shape
    assert x.stride(-1) == 1, x.stride()
    copies = 1 if dest is None else dest.shape[1]
    assert dest is None or (dest.shape[0] == m and dest.is_contiguous()), None if dest is None else dest.shape
    q = torch.empty(m * copies, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m * copies, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(m,)](
            x,
            q,
            s,
            s if dest is None else dest,
            k,
            x.stride(0),
            BLOCK=block,
            COPIES=copies,
            SCATTER=dest is not None,
            num_warps=4 if block <= 2048 else 8,
        )
    return q, s


def gelu_mul_quant_triton(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2I] (gate | up) -> quantised gelu_tanh(gate) * up: (q [M, I] e4m3, scale [M] fp32)."""
    m, two_i = gu.shape
    assert two_i % 2 == 0 and gu.stride(-1) == 1, gu.shape
    inter = two_i // 2
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(m, dtype=torch.float32, device=gu.device)
    if m:
        block = triton.next_power_of_2(inter)
        _gelu_mul_quant_kernel[(m,)](
            gu, q, s, inter, gu.stride(0), _K_BETA, _K_KAPPA, BLOCK=block, num_warps=4 if block <= 2048 else 8
        )
    return q, s


def compile_specs():
    """The row quantiser at the real shape's widths (hidden 2,816; attention out 4,096; dense MLP
    2,112) and scattered to the experts' 8 copies; the gated quantiser at the experts' 704 and the dense
    MLP's 2,112 (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    out = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    for k, copies in ((2816, 1), (2816, 8), (4096, 1), (2112, 1)):
        block = triton.next_power_of_2(k)
        yield CompileSpec(
            f"fp8_quant_rows_k{k}" + (f"_x{copies}" if copies > 1 else ""),
            _quant_rows_kernel,
            {"BLOCK": block, "COPIES": copies, "SCATTER": copies > 1},
            types={**out, "dest_ptr": "*i64" if copies > 1 else "*fp32"},
            divisible=frozenset({"x_ptr", "q_ptr", "s_ptr", "K", "stride_x"}),
            num_warps=4 if block <= 2048 else 8,
        )
    for inter in (704, 2112):
        block = triton.next_power_of_2(inter)
        yield CompileSpec(
            f"fp8_gelu_mul_quant_i{inter}",
            _gelu_mul_quant_kernel,
            {"BLOCK": block},
            types={**out, "k_beta": "fp32", "k_kappa": "fp32"},
            divisible=frozenset({"gu_ptr", "q_ptr", "s_ptr", "I", "stride_g"}),
            num_warps=4 if block <= 2048 else 8,
        )
