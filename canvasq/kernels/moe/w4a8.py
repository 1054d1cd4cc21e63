"""W4A8: the W4 pack's weights against e4m3 activation rows, a grouped GEMM over rows in expert order
(the FP8 experts' contract, `kernels.fp8_grouped`, on half its weight bytes). A prototype for issue 34's
4 x 256 forward, where the e4m3 experts' GEMMs are bound by their 761 MB a layer: not yet on any path.

The pack's nibbles minus their (integer) zero are integers in [-15, 15], exact in e4m3, so a group's
products are exact e4m3 tensor-core sums; its scale goes onto the group's fp32 partial sum. A byte
holds k and k + G/2 of its group (`quant.PACK_LAYOUT`): each group is two dots of G/2. The weights are
converted in registers, so they are the MMA's first operand and the rows its second (swap AB: the
tile is [BLOCK_N columns, BLOCK_M rows], stored transposed); Hopper's wgmma takes its first operand
from registers, its second only from shared memory.

The bias form (`sums` given) skips that per-weight conversion: a nibble's byte 0000nnnn, read as
e4m3, is n * 2^-9 exactly, so the weights need only a mask and a shift; the zero comes off once per
group and row as z * Σx (`group_sums`), the scale's 2^9 with it.

`WT`: the operands' dtype, e4m3 on a GPU; the interpreter's dot takes fp16 (the same values).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import interpreted
from ..fp8_grouped import _my_rows, _tile_of


@triton.jit
def _nibbles(qb, z, BIAS: tl.constexpr, BITCAST: tl.constexpr, WT: tl.constexpr):
    """A byte tile's two nibbles as MMA operands. BIAS: the nibbles themselves, n * 2^-9 (the byte
    0000nnnn read as e4m3 is n * 2^-9 exactly: subnormal below 8, the first binade from 8), their
    zero left to the caller; else n - z, converted through fp32 (exact in e4m3)."""
    if BIAS:
        lo = (qb & 0xF).to(tl.uint8)
        hi = (qb >> 4).to(tl.uint8)
        if BITCAST:
            return lo.to(WT, bitcast=True), hi.to(WT, bitcast=True)
        return (lo.to(tl.float32) * (1.0 / 512)).to(WT), (hi.to(tl.float32) * (1.0 / 512)).to(WT)
    return ((qb & 0xF).to(tl.float32) - z).to(WT), ((qb >> 4).to(tl.float32) - z).to(WT)


@triton.jit
def _w4a8_kernel(
    x_ptr, xs_ptr, xsum_ptr, q_ptr, s_ptr, z_ptr, offs_ptr, out_ptr, M, N,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sg, stride_om, m_tiles, n_tiles,
    K: tl.constexpr, G: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WT: tl.constexpr, BIAS: tl.constexpr,
    BITCAST: tl.constexpr, M_MAJOR: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_of(tl.program_id(0), m_tiles, n_tiles, M_MAJOR)
    expert, row0, end, live = _my_rows(offs_ptr, pid_m, E, E_POW2, BLOCK_M)
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
    sums = xsum_ptr + rows_in.to(tl.int64) * (K // G)  # BIAS: each row's sum over each group
    sz = expert * stride_se + cols_in
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(K // G):
        qb = tl.load(q_ptrs + g * HALF)  # [BLOCK_N, G/2] bytes: k and k + G/2
        z = tl.load(z_ptr + sz + g * stride_sg).to(tl.float32)
        s = tl.load(s_ptr + sz + g * stride_sg).to(tl.float32)
        lo, hi = _nibbles(qb, z[:, None], BIAS, BITCAST, WT)
        part = tl.dot(lo, tl.trans(tl.load(x_ptrs + g * G)))
        part = tl.dot(hi, tl.trans(tl.load(x_ptrs + (g * G + HALF))), part)
        if BIAS:  # s * (sum n x - z sum x), the nibbles read as n * 2^-9: two FMAs an element
            acc += (s * 512.0)[:, None] * part
            acc -= (s * z)[:, None] * tl.load(sums + g)[None, :]
        else:
            acc += part * s[:, None]
    y = acc * tl.load(xs_ptr + rows_in)[None, :]
    keep = (cols < N)[:, None] & (rows < end)[None, :]
    at = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(at, y.to(out_ptr.dtype.element_ty), mask=keep)


def group_sums(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] -> fp32 [M, K/G]: each row's sum over each group of G (the bias form's Σx) for rows
    already quantised; the FP8 path's quantisers write the same as they quantise
    (`fp8_quant.quantize_rows_sums`)."""
    return x.float().view(x.shape[0], -1, group).sum(-1).contiguous()


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
    sums: torch.Tensor | None = None,
    m_major: bool = False,
) -> torch.Tensor:
    """x [M, K] (rows in expert order; e4m3 on a GPU), x_scale [M] fp32, the K-contiguous pack q
    [E, N, K/2] uint8 with scale / zero [E, K/G, N], offs [E] int32 (each expert's end) -> [M, N]
    in out_dtype: row r times (q - zero) * scale of its expert, times x_scale[r]. K a multiple of G.
    `sums` (`group_sums(x)`): the bias form, the nibbles read as e4m3 bytes and the zero applied once
    per group as z * Σx, instead of n - z converted per weight. `m_major`: the launch order
    (`fp8_grouped._tile_of`)."""
    m, k = x.shape
    n_experts, n, k2 = q.shape
    group = k // scale.shape[1]
    assert k2 * 2 == k and k % group == 0 and x.stride(1) == 1 and q.stride(2) == 1, (x.shape, q.shape)
    assert scale.stride() == zero.stride() and scale.stride(2) == 1, (scale.stride(), zero.stride())
    assert sums is None or sums.shape == (m, k // group) and sums.is_contiguous(), "sums: group_sums(x)"
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    compiled = not interpreted(_w4a8_kernel)
    assert group >= 64 or not compiled, f"group {group}: an e4m3 dot takes K >= 32, half a group"
    m_tiles, n_tiles = triton.cdiv(m, block_m) + n_experts, triton.cdiv(n, block_n)
    _w4a8_kernel[(m_tiles * n_tiles,)](
        x, x_scale, x_scale if sums is None else sums, q, scale, zero, offs, out, m, n,
        x.stride(0), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1), out.stride(0), m_tiles, n_tiles,
        K=k, G=group, E=n_experts, E_POW2=triton.next_power_of_2(n_experts), BLOCK_M=block_m,
        BLOCK_N=block_n, WT=tl.float8e4nv if compiled else tl.float16, BIAS=sums is not None,
        BITCAST=compiled, M_MAJOR=m_major, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@dataclass
class W4A8Matrix:
    """One projection of the W4 pack as the W4A8 GEMMs read it. On Hopper (`wgmma_here`) the bytes in
    the wgmma kernel's order (`gluon_pack.tile_q8`) with its scale/zero words (`pack_scale_zero8`),
    for `gluon_w4a8.w4a8_wgmma`; elsewhere the K-contiguous pack for this module's Triton kernel."""

    q: torch.Tensor  # [E, N, K/2] uint8, or tile_q8's [E, N/16, K/G, 8G]
    scale: torch.Tensor  # [E, K/G, N]; with wgmma the packed words, int32
    zero: torch.Tensor | None  # None with wgmma (in the words)
    group: int
    tiles: tuple[int, ...]  # the launch's block_m, block_n, warps (and stages with wgmma)

    @classmethod
    def of(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, wgmma: bool | None = None):
        """The projection q [E, N, K/2], scale / zero [E, K/G, N]; `wgmma` None: `wgmma_here`."""
        group = 2 * q.shape[2] // scale.shape[1]
        if wgmma is None:
            wgmma = wgmma_here(q.device, scale.dtype, group, q.shape[1])
        if not wgmma:
            return cls(q, scale, zero, group, (64, 128, 4))
        from .gluon_pack import pack_scale_zero8, tile_q8

        stages = min(3, 2 * q.shape[2] // group + 1)  # at most a stage a group, and one more
        return cls(tile_q8(q, group), pack_scale_zero8(scale, zero), None, group, (64, 64, 4, stages, 1))

    @property
    def wgmma(self) -> bool:
        return self.zero is None

    def gemm(self, x: torch.Tensor, xs: torch.Tensor, sums: torch.Tensor, offs: torch.Tensor, dtype):
        """Rows x [M, K] e4m3 in expert order, their scales and group sums -> [M, N] in dtype."""
        if self.zero is not None:
            bm, bn, warps = self.tiles[:3]
            return w4a8_grouped(x, xs, self.q, self.scale, self.zero, offs, dtype, bm, bn, warps, sums=sums)
        from .gluon_w4a8 import w4a8_wgmma

        return w4a8_wgmma(x, xs, sums, self.q, self.scale, offs, dtype, self.tiles)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [E, N, K/2] K-contiguous, scale, zero) whichever order is held (the twin reads them)."""
        if self.zero is not None:
            return self.q, self.scale, self.zero
        from .gluon_pack import unpack_scale_zero8, untile_q8

        return untile_q8(self.q), *unpack_scale_zero8(self.scale)


def wgmma_here(device: torch.device, scale_dtype: torch.dtype, group: int, n: int) -> bool:
    """The wgmma kernel serves this projection: a compiled sm_90 device, bf16 scales (its words hold
    bf16 bits), groups of 64 or 128, N a multiple of its 64-column tiles."""
    if device.type != "cuda" or scale_dtype != torch.bfloat16 or group not in (64, 128) or n % 64:
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0) and not interpreted(_w4a8_kernel)


def compile_specs():
    """Both GEMMs at the real shape (H 2,816, I 704, 128 experts; groups 128 and 64), each form at the
    sweep's tilings (benchmarks/kernels/compile_check.py)."""
    from ..compile_spec import CompileSpec, pointers_and_strides

    types = {"x_ptr": "*fp8e4nv", "q_ptr": "*u8", "xs_ptr": "*fp32", "xsum_ptr": "*fp32", "offs_ptr": "*i32"}
    divisible = pointers_and_strides(_w4a8_kernel)
    for (name, k, group), (bm, bn, warps), bias in itertools.product(
        (("gate_up", 2816, 128), ("down", 704, 64)), ((64, 128, 4), (64, 128, 8), (64, 256, 8)), (False, True)
    ):
        yield CompileSpec(
            f"w4a8{'_bias' if bias else ''}_{name}_m{bm}n{bn}w{warps}",
            _w4a8_kernel,
            {"K": k, "G": group, "E": 128, "E_POW2": 128, "BLOCK_M": bm, "BLOCK_N": bn}
            | {"WT": tl.float8e4nv, "BIAS": bias, "BITCAST": True, "M_MAJOR": False},
            types=types,
            divisible=divisible,
            num_warps=warps,
            num_stages=3,
        )
