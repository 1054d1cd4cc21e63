"""A grouped GEMM over rows in expert order, one Triton launch: out[r] = (a[r] @ W[e(r)].T) * a_scale[r]
* w_scale[e(r)], the contract of `torch._scaled_grouped_mm` with row-wise scales (the FP8 experts'
path, `model.fp8._grouped`).

Rows come sorted by expert with each expert's end in `offs` (int32 [E], cumulative, as torch takes
it). Each program finds its expert and its BLOCK_M rows from `offs` on the device (a prefix sum of the
experts' tile counts), so the grid is fixed by (rows, E) and a CUDA graph can hold the launch. Its
weight tile is the expert's [BLOCK_N, K] slice in HF's layout (W [E, N, K], K contiguous: the operand
Hopper's FP8 tensor cores read without a transpose). Programs are ordered with the row tiles fastest,
so the row tiles of one expert and column tile run side by side and share the weight tile in L2.

A persistent launch (`Tiles.persistent`) starts that many programs an SM instead, each looping over
the live tiles; Triton flattens the tile and K loops into one, so a tile's first loads are in flight
while the tile before it is scaled and stored (the down GEMM's K of 704 is six blocks of 128: a
one-tile program fills and drains its pipeline within those six).

Rows past an expert's count are loaded from the next expert's rows (or the last row: never out of
bounds) and not stored: loads need no row mask. Any dtype `tl.dot` takes works (e4m3 on the GPU,
fp16/fp32 under the interpreter, which the CPU tests use).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import fp8_quant
from ._dispatch import interpreted, pdl_kwargs
from ._math import pdl_enter, tanh
from .fp8_grouped_tiles import Tiles, tiles_for
from .moe.config import device_name

# gelu_tanh's constants, as `gelu_mul_quant` takes them
_K_BETA: tl.constexpr = tl.constexpr(fp8_quant._K_BETA)
_K_KAPPA: tl.constexpr = tl.constexpr(fp8_quant._K_KAPPA)


@triton.jit
def _tile_of(pid, m_tiles, n_tiles, M_MAJOR: tl.constexpr):
    """(row tile, column tile) of program pid. Column tiles outer: each pass over every expert's rows
    takes one column block of each expert's weights, so all the rows are read once per column block
    (from L2 while they fit). M_MAJOR, row tiles outer: a row tile's column blocks run side by side,
    its rows read from HBM about once, each expert's weights once per row tile of that expert."""
    if M_MAJOR:
        return pid // n_tiles, pid % n_tiles
    return pid % m_tiles, pid // m_tiles


@triton.jit
def _expert_tiles(offs_ptr, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each expert's (first row, end, row tiles, running tile count) from `offs`, as [E_POW2] vectors."""
    e = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    counts = tl.where(e < E, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _rows_of(starts, ends, tiles, passed, pid_m, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, the expert's end) of row tile pid_m: the first expert whose running tile
    count passes pid_m."""
    e = tl.arange(0, E_POW2)
    expert = tl.sum((passed <= pid_m).to(tl.int32), 0)
    mine = e == expert
    start = tl.sum(tl.where(mine, starts, 0), 0)
    end = tl.sum(tl.where(mine, ends, 0), 0)
    first_tile = tl.sum(tl.where(mine, passed - tiles, 0), 0)
    return expert, start + (pid_m - first_tile) * BLOCK_M, end


@triton.jit
def _my_rows(offs_ptr, pid_m, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, the expert's end, live) of row tile pid_m; live is false past the last tile."""
    starts, ends, tiles, passed = _expert_tiles(offs_ptr, E, E_POW2, BLOCK_M)
    expert, row0, end = _rows_of(starts, ends, tiles, passed, pid_m, E_POW2, BLOCK_M)
    return expert, row0, end, pid_m < tl.sum(tiles, 0)


@triton.jit
def _scaled_store(
    acc,
    acc_u,
    row0,
    end,
    expert,
    cols,
    as_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    stride_wse,
    stride_om,
    BLOCK_M: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The tile's rows times their scales, stored in the output's dtype; GATED: gelu_tanh(gate) * up of
    the gate (acc) and up (acc_u) tiles, rounded where `gelu_mul_quant` rounds (the gate/up output,
    the activation, the product)."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = row0 + tl.arange(0, BLOCK_M)
    a_s = tl.load(as_ptr + tl.minimum(rows, M - 1))[:, None]
    w_at = ws_ptr + expert * stride_wse + tl.minimum(cols, N - 1)
    y = acc * a_s * tl.load(w_at)[None, :]
    if GATED:
        g = y.to(DT).to(tl.float32)
        u = (acc_u * a_s * tl.load(w_at + N)[None, :]).to(DT).to(tl.float32)
        act = (0.5 * g * (1.0 + tanh(_K_BETA * (g + _K_KAPPA * (g * g * g)), INTERPRETED))).to(DT)
        y = act.to(tl.float32) * u
    keep = (rows < end)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], y.to(DT), mask=keep)


@triton.jit
def _products(
    a_ptr,
    w_ptr,
    row0,
    expert,
    cols,
    M,
    N,
    stride_am,
    stride_we,
    stride_wn,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IMPRECISE: tl.constexpr,
    GATED: tl.constexpr,
):
    """The tile's products through pointers (cp.async): (acc, the up half's acc when GATED)."""
    ks = tl.arange(0, BLOCK_K)
    rows_in = tl.minimum(row0 + tl.arange(0, BLOCK_M), M - 1)
    a_ptrs = a_ptr + rows_in.to(tl.int64)[:, None] * stride_am + ks[None, :]
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + ks[:, None]
    up = N * stride_wn  # GATED: the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = (k0 + ks) < K
        a = tl.load(a_ptrs) if EVEN_K else tl.load(a_ptrs, mask=mk[None, :], other=0.0)
        b = tl.load(w_ptrs) if EVEN_K else tl.load(w_ptrs, mask=mk[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
        if GATED:
            b = tl.load(w_ptrs + up) if EVEN_K else tl.load(w_ptrs + up, mask=mk[:, None], other=0.0)
            acc_u = tl.dot(a, b, acc_u, max_num_imprecise_acc=IMPRECISE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_u


@triton.jit
def _products_tma(
    a_desc,
    w_desc,
    row0,
    w_row,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IMPRECISE: tl.constexpr,
    GATED: tl.constexpr,
):
    """The same through TMA descriptors, the weights as one [E * N, K] matrix: a column tile past N
    reads the next expert's rows (or zeros past the last), which the store drops; rows and K past
    their ends read zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        acc = tl.dot(a, w_desc.load([w_row, k0]).T, acc, max_num_imprecise_acc=IMPRECISE)
        if GATED:
            acc_u = tl.dot(a, w_desc.load([w_row + N, k0]).T, acc_u, max_num_imprecise_acc=IMPRECISE)
    return acc, acc_u


@triton.jit
def _grouped_kernel(
    a,
    as_ptr,
    w,
    ws_ptr,
    offs_ptr,
    out_ptr,
    M,
    N,
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    stride_om,
    m_tiles,
    n_tiles,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IMPRECISE: tl.constexpr,
    GATED: tl.constexpr,
    TMA: tl.constexpr,
    M_MAJOR: tl.constexpr,
    PERSISTENT: tl.constexpr,
    ITERS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    # a, w: pointers, or with TMA their descriptors; `ops`: what every tile reads and writes
    pdl_enter(PDL)
    ops = (a, as_ptr, w, ws_ptr, out_ptr, M, N, stride_am, stride_we, stride_wn, stride_wse, stride_om)
    table = _expert_tiles(offs_ptr, E, E_POW2, BLOCK_M)
    m_live = tl.sum(table[2], 0)
    if not PERSISTENT:  # one tile a program, the grid every tile there can be (m_tiles: a bound)
        if tl.program_id(0) < m_live * n_tiles:
            _tile_at(
                tl.program_id(0), m_live, n_tiles, table, ops, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                IMPRECISE, GATED, TMA, M_MAJOR, INTERPRETED,
            )  # fmt: skip
    elif INTERPRETED:  # the interpreter takes only Python ints as loop bounds: ITERS, the host's bound
        for i in range(ITERS):
            t = tl.program_id(0) + i * tl.num_programs(0)
            if t < m_live * n_tiles:
                _tile_at(
                    t, m_live, n_tiles, table, ops, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IMPRECISE,
                    GATED, TMA, M_MAJOR, INTERPRETED,
                )  # fmt: skip
    else:  # the live tiles, every num_programs-th; the tile and K loops flattened, loads pipelined across
        for t in tl.range(tl.program_id(0), m_live * n_tiles, tl.num_programs(0), flatten=True):
            _tile_at(
                t, m_live, n_tiles, table, ops, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IMPRECISE,
                GATED, TMA, M_MAJOR, INTERPRETED,
            )  # fmt: skip


@triton.jit
def _tile_at(
    t,
    m_live,
    n_tiles,
    table,
    ops,
    K: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IMPRECISE: tl.constexpr,
    GATED: tl.constexpr,
    TMA: tl.constexpr,
    M_MAJOR: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Tile t of the live tiles (`_tile_of` over m_live row tiles): its products, scaled and stored."""
    a, as_ptr, w, ws_ptr, out_ptr, M, N, stride_am, stride_we, stride_wn, stride_wse, stride_om = ops
    pid_m, pid_n = _tile_of(t, m_live, n_tiles, M_MAJOR)
    starts, ends, tiles, passed = table
    expert, row0, end = _rows_of(starts, ends, tiles, passed, pid_m, E_POW2, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:
        w_row = expert * (2 * N if GATED else N) + pid_n * BLOCK_N
        acc, acc_u = _products_tma(a, w, row0, w_row, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IMPRECISE, GATED)
    else:
        acc, acc_u = _products(
            a, w, row0, expert, cols, M, N, stride_am, stride_we, stride_wn,
            K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IMPRECISE, GATED,
        )  # fmt: skip
    _scaled_store(
        acc, acc_u, row0, end, expert, cols, as_ptr, ws_ptr, out_ptr, M, N, stride_wse, stride_om,
        BLOCK_M, GATED, INTERPRETED,
    )  # fmt: skip


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """a [M, K] (rows in expert order), a_scale [M] fp32, w [E, N, K], w_scale [E, N] fp32, offs [E]
    int32 (each expert's end) -> [M, N] in out_dtype (into `out` if given). Rows past offs[-1] are
    left unwritten. `gated`: W holds gate | up rows ([E, 2I, K]) and the output is gelu_tanh(gate) *
    up, [M, I] (what `gelu_mul` gives on the [M, 2I] output)."""
    (m, k), (n_experts, n_w, k_w) = a.shape, w.shape
    tiles = tiles or tiles_for(m, n_experts, n_w, k, gated, device_name(a.device))
    n = n_w // 2 if gated else n_w
    assert k_w == k and a.stride(1) == 1 and w.stride(2) == 1, (a.shape, w.shape)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    assert out.shape == (m, n) and out.stride(1) == 1, out.shape
    if m == 0:
        return out
    _launch(tiles, a, a_scale, w, w_scale, offs, out, gated)
    return out


def _launch(tiles: Tiles, a, a_scale, w, w_scale, offs, out, gated: bool) -> None:
    (m, k), n_experts, n = a.shape, w.shape[0], out.shape[1]
    m_tiles = triton.cdiv(m, tiles.block_m) + n_experts  # an upper bound: each expert rounds up once
    n_tiles = triton.cdiv(n, tiles.block_n)
    strides = (a.stride(0), w.stride(0), w.stride(1))
    if tiles.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a = TensorDescriptor.from_tensor(a, [tiles.block_m, tiles.block_k])
        w = TensorDescriptor.from_tensor(w.view(-1, k), [tiles.block_n, tiles.block_k])
    grid, interp = m_tiles * n_tiles, interpreted(_grouped_kernel)
    if tiles.persistent:
        grid = min(grid, tiles.persistent * _sm_count(a_scale.device))
    _grouped_kernel[(grid,)](
        a, a_scale, w, w_scale, offs, out, m, n, *strides, w_scale.stride(0), out.stride(0), m_tiles, n_tiles,
        K=k, E=n_experts, E_POW2=triton.next_power_of_2(n_experts), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
        IMPRECISE=tiles.imprecise, GATED=gated, TMA=tiles.tma, M_MAJOR=tiles.m_major,
        PERSISTENT=tiles.persistent > 0, ITERS=triton.cdiv(m_tiles * n_tiles, grid) if interp else 0,
        INTERPRETED=interp,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl_kwargs(a_scale, _grouped_kernel),
    )  # fmt: skip


def _sm_count(device: torch.device) -> int:
    """The device's SMs (a persistent launch's programs per SM multiply it); under the interpreter a
    few, so the CPU tests walk each program over several tiles."""
    return 3 if device.type != "cuda" else _cuda_sms(device.index or 0)


@functools.lru_cache(maxsize=8)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def compile_specs():
    """The experts' two GEMMs at the real shape (H 2,816, I 704, 128 experts) with `tiles_for`'s
    tilings, as `fp8_moe` launches them, gate/up with the gated epilogue the sweep times, and at 1,024
    tokens the persistent launches the sweep times (benchmarks/kernels/compile_check.py)."""
    gemms = (("gate_up", 1408, 2816, False), ("gate_up_act", 1408, 2816, True), ("down", 2816, 704, False))
    for rows in (1024 * 8, 4096 * 8):
        for name, n, k, gated in gemms:
            t = tiles_for(rows, 128, n, k, gated, "NVIDIA_H200")
            yield _spec(f"fp8_grouped_{name}_m{t.block_m}n{t.block_n}", t, k, gated)
    for t in (
        Tiles(64, 128, 128, 4, 4, tma=True, m_major=True, persistent=2),
        Tiles(64, 128, 128, 4, 4, persistent=2),
    ):
        for name, _, k, gated in gemms[::2]:
            yield _spec(
                f"fp8_grouped_{name}_m{t.block_m}n{t.block_n}_persistent{'_tma' if t.tma else ''}",
                t,
                k,
                gated,
            )


def _spec(name: str, t: Tiles, k: int, gated: bool):
    from .compile_spec import CompileSpec, pointers_and_strides

    types = {"a": "*fp8e4nv", "w": "*fp8e4nv", "as_ptr": "*fp32", "ws_ptr": "*fp32", "offs_ptr": "*i32"}
    # N as Triton specialises it at the real widths (multiples of 16): the epilogue's stores vectorise
    divisible = pointers_and_strides(_grouped_kernel, "a", "w", "N")
    if t.tma:  # host-side descriptors, of the blocks `_launch` gives them
        types |= {"a": f"tensordesc<fp8e4nv[{t.block_m}, {t.block_k}]>"}
        types |= {"w": f"tensordesc<fp8e4nv[{t.block_n}, {t.block_k}]>"}
        divisible -= {"a", "w"}
    blocks = {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "IMPRECISE": t.imprecise}
    flags = {"TMA": t.tma, "M_MAJOR": t.m_major, "PERSISTENT": t.persistent > 0, "ITERS": 0}
    return CompileSpec(
        name,
        _grouped_kernel,
        {"K": k, "E": 128, "E_POW2": 128, "EVEN_K": k % t.block_k == 0, "GATED": gated, "INTERPRETED": False}
        | flags
        | blocks,
        types=types,
        divisible=divisible,
        num_warps=t.warps,
        num_stages=t.stages,
    )
