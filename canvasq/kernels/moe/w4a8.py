"""W4A8: the W4 pack's weights against e4m3 activation rows, a grouped GEMM over rows in expert order
(the FP8 experts' contract, `kernels.fp8_grouped`, on half its weight bytes). A prototype for issue 34's
4 x 256 forward, where the e4m3 experts' GEMMs are bound by their 761 MB a layer: not yet on any path.

The pack's nibbles minus their (integer) zero are integers in [-15, 15], exact in e4m3, so a group's
products are exact e4m3 tensor-core sums; its scale goes onto the group's fp32 partial sum. A byte
holds k and k + G/2 of its group (`quant.PACK_LAYOUT`): each group is two dots of G/2. The weights are
converted in registers, so they are the MMA's first operand and the rows its second (swap AB: the
tile is [BLOCK_N columns, BLOCK_M rows], stored transposed); Hopper's wgmma takes its first operand
from registers, its second only from shared memory.

`WT`: the operands' dtype, e4m3 on a GPU; the interpreter's dot takes fp16 (the same values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import interpreted
from ..fp8_grouped import _my_rows


@triton.jit
def _w4a8_kernel(
    x_ptr, xs_ptr, q_ptr, s_ptr, z_ptr, offs_ptr, out_ptr, M, N,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sg, stride_om, m_tiles,
    K: tl.constexpr, G: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_n = pid // m_tiles
    expert, row0, end, live = _my_rows(offs_ptr, pid % m_tiles, E, E_POW2, BLOCK_M)
    if not live:
        return
    HALF: tl.constexpr = G // 2
    js = tl.arange(0, HALF)
    rows = row0 + tl.arange(0, BLOCK_M)
    rows_in = tl.minimum(rows, M - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = tl.minimum(cols, N - 1)
    q_ptrs = q_ptr + expert.to(tl.int64) * stride_qe + cols_in.to(tl.int64)[:, None] * stride_qn + js[None, :]
    x_ptrs = x_ptr + rows_in.to(tl.int64)[:, None] * stride_xm + js[None, :]
    sz = expert * stride_se + cols_in
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(K // G):
        qb = tl.load(q_ptrs + g * HALF)  # [BLOCK_N, G/2] bytes: k and k + G/2
        z = tl.load(z_ptr + sz + g * stride_sg).to(tl.float32)[:, None]
        lo = ((qb & 0xF).to(tl.float32) - z).to(WT)
        hi = ((qb >> 4).to(tl.float32) - z).to(WT)
        part = tl.dot(lo, tl.trans(tl.load(x_ptrs + g * G)))
        part = tl.dot(hi, tl.trans(tl.load(x_ptrs + (g * G + HALF))), part)
        acc += part * tl.load(s_ptr + sz + g * stride_sg).to(tl.float32)[:, None]
    y = acc * tl.load(xs_ptr + rows_in)[None, :]
    keep = (cols < N)[:, None] & (rows < end)[None, :]
    at = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(at, y.to(out_ptr.dtype.element_ty), mask=keep)


def w4a8_grouped(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    block_m: int = 64,
    block_n: int = 128,
    warps: int = 4,
    stages: int = 3,
) -> torch.Tensor:
    """x [M, K] (rows in expert order; e4m3 on a GPU), x_scale [M] fp32, the K-contiguous pack q
    [E, N, K/2] uint8 with scale / zero [E, K/G, N], offs [E] int32 (each expert's end) -> [M, N]
    in out_dtype: row r times (q - zero) * scale of its expert, times x_scale[r]. K a multiple of G."""
    m, k = x.shape
    n_experts, n, k2 = q.shape
    group = k // scale.shape[1]
    assert k2 * 2 == k and k % group == 0 and x.stride(1) == 1 and q.stride(2) == 1, (x.shape, q.shape)
    assert scale.stride() == zero.stride() and scale.stride(2) == 1, (scale.stride(), zero.stride())
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    compiled = not interpreted(_w4a8_kernel)
    m_tiles = triton.cdiv(m, block_m) + n_experts
    _w4a8_kernel[(m_tiles * triton.cdiv(n, block_n),)](
        x, x_scale, q, scale, zero, offs, out, m, n,
        x.stride(0), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1), out.stride(0), m_tiles,
        K=k, G=group, E=n_experts, E_POW2=triton.next_power_of_2(n_experts), BLOCK_M=block_m,
        BLOCK_N=block_n, WT=tl.float8e4nv if compiled else tl.float16, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
