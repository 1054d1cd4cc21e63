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

from ._dispatch import interpreted, pdl_kwargs
from ._math import pdl_enter, tanh

E4M3_MAX = 448.0
_K_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
_K_KAPPA = 0.044715


@triton.jit
def _group_sums(q, sums_ptr, row, K, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Row `row`'s sums over each group of GROUP of the quantised values q [BLOCK] (`moe.w4a8`'s bias
    form reads them: its zero times the rows' sum). GROUP 0: none."""
    if GROUP > 0:
        g = tl.arange(0, BLOCK // GROUP)
        sums = tl.sum(tl.reshape(q.to(tl.float32), (BLOCK // GROUP, GROUP)), 1)
        tl.store(sums_ptr + row * (K // GROUP) + g, sums, mask=g < K // GROUP)


@triton.jit
def quant_tile_store(y, q_ptr, s_ptr, rows, cols, mask, R, K):
    """The rows of an fp32 tile y [BLOCK_R, BLOCK_D] (values already rounded to the model dtype, masked
    lanes 0) quantised as `_quant_rows_kernel` quantises a row: e4m3 q[rows, cols] (row stride K) and
    fp32 scale[rows]. The norms that feed an FP8 GEMM call it instead of storing their output, so the
    model-dtype rows are never written and read back."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) / 448.0
    q = tl.clamp(y / scale[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < R)


def quant_outputs(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q [rows, k] e4m3, scale [rows] fp32), as the row quantisers write them."""
    return (
        torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    dest_ptr,
    sums_ptr,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    COPIES: tl.constexpr,
    SCATTER: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    # SCATTER: the row's COPIES quantised copies go to output rows dest[row, 0..COPIES)
    pdl_enter(PDL)
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
            _group_sums(q, sums_ptr, out, K, BLOCK, GROUP)
    else:
        tl.store(q_ptr + row * K + cols, q, mask=m)
        tl.store(s_ptr + row, scale)
        _group_sums(q, sums_ptr, row, K, BLOCK, GROUP)


@triton.jit
def _gelu_mul_quant_kernel(
    gu_ptr,
    q_ptr,
    s_ptr,
    sums_ptr,
    I,
    stride_g,
    k_beta,
    k_kappa,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    # one row a program: at 2, 4 and 8 rows (a tile through `quant_tile_store`) it was slower at every
    # width and row count on an H100 (BENCHMARKS "Persistent grouped GEMM, PDL, routing order and
    # deferred heads")
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + I + cols, mask=m, other=0.0)
    y = _gelu_mul(g, u, k_beta, k_kappa, INTERPRETED)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.clamp(y / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * I + cols, q, mask=m)
    tl.store(s_ptr + row, scale)
    _group_sums(q, sums_ptr, row, I, BLOCK, GROUP)


@triton.jit
def _gelu_mul(g, u, k_beta, k_kappa, INTERPRETED: tl.constexpr):
    """gelu_tanh(g) * u in fp32 from model-dtype g, u, each result rounded to their dtype as HF rounds."""
    DT: tl.constexpr = g.dtype
    g = g.to(tl.float32)
    act = (0.5 * g * (1.0 + tanh(k_beta * (g + k_kappa * (g * g * g)), INTERPRETED))).to(DT).to(tl.float32)
    return (act * u.to(tl.float32)).to(DT).to(tl.float32)


def quantize_rows_triton(
    x: torch.Tensor, dest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K] e4m3, scale [M] fp32). With `dest` [M, c] (a
    permutation of the output rows): row i's copies go to rows dest[i] of q [M*c, K] and scale
    [M*c] (the MoE's rows in expert order, without quantising first and gathering after)."""
    q, s, _ = _quantize_rows(x, dest, 0)
    return q, s


def quantize_rows_sums(x: torch.Tensor, group: int, dest: torch.Tensor | None = None):
    """`quantize_rows_triton` and each output row's sums of q over each group of `group` columns (a
    power of two dividing K): (q, scale, sums fp32 [M*c, K/group])."""
    return _quantize_rows(x, dest, group)


def _quantize_rows(x: torch.Tensor, dest: torch.Tensor | None, group: int):
    m, k = x.shape
    assert x.stride(-1) == 1, x.stride()
    copies = 1 if dest is None else dest.shape[1]
    assert dest is None or (dest.shape[0] == m and dest.is_contiguous()), None if dest is None else dest.shape
    q = torch.empty(m * copies, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m * copies, dtype=torch.float32, device=x.device)
    sums = _sums_for(m * copies, k, group, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(m,)](
            x,
            q,
            s,
            s if dest is None else dest,
            s if sums is None else sums,
            k,
            x.stride(0),
            BLOCK=block,
            COPIES=copies,
            SCATTER=dest is not None,
            GROUP=group,
            num_warps=4 if block <= 2048 else 8,
            **pdl_kwargs(x, _quant_rows_kernel),
        )
    return q, s, sums


def gelu_mul_quant_triton(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2I] (gate | up) -> quantised gelu_tanh(gate) * up: (q [M, I] e4m3, scale [M] fp32)."""
    q, s, _ = _gelu_mul_quant(gu, 0)
    return q, s


def gelu_mul_quant_sums(gu: torch.Tensor, group: int):
    """`gelu_mul_quant_triton` and its group sums (as `quantize_rows_sums`'s)."""
    return _gelu_mul_quant(gu, group)


def _gelu_mul_quant(gu: torch.Tensor, group: int):
    m, two_i = gu.shape
    assert two_i % 2 == 0 and gu.stride(-1) == 1, gu.shape
    inter = two_i // 2
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(m, dtype=torch.float32, device=gu.device)
    sums = _sums_for(m, inter, group, gu.device)
    if m:
        block = triton.next_power_of_2(inter)
        _gelu_mul_quant_kernel[(m,)](
            gu, q, s, s if sums is None else sums, inter, gu.stride(0), _K_BETA, _K_KAPPA,
            BLOCK=block, GROUP=group, INTERPRETED=interpreted(_gelu_mul_quant_kernel),
            num_warps=4 if block <= 2048 else 8, **pdl_kwargs(gu, _gelu_mul_quant_kernel),
        )  # fmt: skip
    return q, s, sums


def _sums_for(rows: int, k: int, group: int, device) -> torch.Tensor | None:
    if not group:
        return None
    assert group & (group - 1) == 0 and k % group == 0, f"group {group}: a power of two dividing {k}"
    return torch.empty(rows, k // group, dtype=torch.float32, device=device)


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
            {"BLOCK": block, "COPIES": copies, "SCATTER": copies > 1, "GROUP": 0},
            types={**out, "dest_ptr": "*i64" if copies > 1 else "*fp32", "sums_ptr": "*fp32"},
            divisible=frozenset({"x_ptr", "q_ptr", "s_ptr", "K", "stride_x"}),
            num_warps=4 if block <= 2048 else 8,
        )
    for k, group in ((2816, 128), (704, 64)):  # with the group sums `moe.w4a8`'s bias form reads
        kernel = _quant_rows_kernel if k == 2816 else _gelu_mul_quant_kernel
        block = triton.next_power_of_2(k)
        const = {"COPIES": 8, "SCATTER": True} if k == 2816 else {}
        yield CompileSpec(
            f"fp8_{kernel.__name__.strip('_').removesuffix('_kernel')}_k{k}_g{group}",
            kernel,
            {"BLOCK": block, "GROUP": group} | const | ({} if k == 2816 else {"INTERPRETED": False}),
            types={**out, "dest_ptr": "*i64", "sums_ptr": "*fp32", "k_beta": "fp32", "k_kappa": "fp32"},
            num_warps=4 if block <= 2048 else 8,
        )
    for inter in (704, 2112):
        block = triton.next_power_of_2(inter)
        yield CompileSpec(
            f"fp8_gelu_mul_quant_i{inter}",
            _gelu_mul_quant_kernel,
            {"BLOCK": block, "GROUP": 0, "INTERPRETED": False},
            types={**out, "sums_ptr": "*fp32", "k_beta": "fp32", "k_kappa": "fp32"},
            divisible=frozenset({"gu_ptr", "q_ptr", "s_ptr", "I", "stride_g"}),
            num_warps=4 if block <= 2048 else 8,
        )
