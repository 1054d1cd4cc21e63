"""W4A8 on Hopper's warpgroup MMA, in Gluon: the W4 pack's nibbles against e4m3 activation rows, a
grouped GEMM over rows in expert order (`moe.w4a8`'s contract, and so `fp8_grouped`'s). sm_90 only,
compiled: the CPU interpreter cannot run Gluon, so CPU CI checks the byte order (`gluon_pack.tile_q8`)
and compiles this kernel for sm_90; the GPU tests run it against `w4a8.w4a8_grouped`.

Why another W4A8 kernel: the Triton one leaves the operands' register layouts to the compiler, which
lowers it to mma.sync and spends most of an iteration converting nibbles (BENCHMARKS, "Persistent
grouped GEMM, PDL, routing order and deferred heads"). Here:

- swap AB: the weights are wgmma's A operand, from registers (rows = output columns n, 64 a
  warpgroup), and the BM rows of one expert its B operand, from shared memory (K-major: e4m3 wgmma
  takes no other order);
- the packed bytes are in `tile_q8`'s order, so each lane loads its A registers for a group as they
  are: 32 contiguous bytes (G 128) or 16 (G 64), one or two 16-byte loads, a warp's 1 KB contiguous;
- a byte's low nibble n is k of the group's first half and its high nibble k + G/2 (`quant.PACK_LAYOUT`);
  the byte 0000nnnn read as e4m3 is n * 2^-9 exactly, so a register of four bytes becomes four e4m3
  weights with one `and` (low) or a shift and an `and` (high): the bias form of `moe.w4a8`, the zero
  taken off once per group and row as z * sum(x) (`sums`, written by the quantiser);
- per group, two wgmma (the low and high halves) into a zeroed partial sum, then
  acc += (512 s) * part - (s z) * sum(x): the scale goes onto the group's fp32 partial sum;
- the activation tiles come in by cp.async through STAGES shared-memory buffers; the next group's weight
  bytes and scales wait in registers while this group multiplies.

Letters as in `w4a8.py`; HB = G/2 packed bytes a row a group; BN output columns a program (64 a warpgroup
or a multiple), BM rows.
"""

from __future__ import annotations

import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma

from .gluon_w4 import _pdl_enter

_LOW_PTX: gl.constexpr = gl.constexpr("and.b32 $0, $1, 0x0F0F0F0F;")
_HIGH_PTX: gl.constexpr = gl.constexpr("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }")


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _my_rows(offs_ptr, pid_m, E: gl.constexpr, E_POW2: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr):
    """(expert, first row, the expert's end, live) of row tile pid_m: `fp8_grouped._my_rows` in Gluon
    (each expert's tiles counted from `offs`, the first expert whose running count passes pid_m)."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    e = gl.arange(0, E_POW2, layout=L)
    ends = gl.load(offs_ptr + e, mask=e < E, other=0)
    starts = gl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    tiles = (gl.where(e < E, ends - starts, 0) + BM - 1) // BM
    passed = gl.associative_scan(tiles, 0, _add)
    expert = gl.sum((passed <= pid_m).to(gl.int32), 0)
    mine = e == expert
    start = gl.sum(gl.where(mine, starts, 0), 0)
    end = gl.sum(gl.where(mine, ends, 0), 0)
    first = gl.sum(gl.where(mine, passed - tiles, 0), 0)
    return expert, start + (pid_m - first) * BM, end, pid_m < gl.sum(tiles, 0)


@gluon.constexpr_function
def _word_layout(BN, HB, NW):
    """The [BN/16, 32, HB/8] int32 word tile as loaded: a lane's HB/8 words of one 16-row tile contiguous."""
    return gl.BlockedLayout([1, 1, HB // 8], [1, 32, 1], [NW, 1, 1], [2, 1, 0])


@gluon.jit
def _operands(qw, BN: gl.constexpr, HB: gl.constexpr, A: gl.constexpr):
    """Loaded words [BN/16, 32, HB/8] (`tile_q8`) -> the low and high nibbles as wgmma A operands
    [BN, HB] e4m3 (n * 2^-9), with register renaming only: lane 4g + t, byte 8j + 4r + b of the lane
    is row 16T + 8r + g, k 16j + 4t + b."""
    lo = gl.inline_asm_elementwise(_LOW_PTX, "=r,r", [qw], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(_HIGH_PTX, "=r,r", [qw], dtype=gl.int32, is_pure=True, pack=1)
    return _as_operand(lo, BN, HB, A), _as_operand(hi, BN, HB, A)


@gluon.jit
def _as_operand(w, BN: gl.constexpr, HB: gl.constexpr, A: gl.constexpr):
    """Words [BN/16, 32, HB/8] -> their bytes (little-endian, so a lane's bytes stay in load order)
    renamed to the A operand [BN, HB]: the splits and joins only name the bytes of registers held."""
    b0, b1 = w.to(gl.int8), (w >> 8).to(gl.int8)
    b2, b3 = (w >> 16).to(gl.int8), (w >> 24).to(gl.int8)
    t = gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [BN // 16, 8, 4, HB // 16, 2, 4])  # T g t j r b
    t = gl.reshape(gl.permute(t, [0, 4, 1, 3, 2, 5]), [BN, HB])  # T, r, g, j, t, b
    return gl.convert_layout(t.to(gl.float8e4nv, bitcast=True), A, assert_trivial=True)


@gluon.jit
def _stage_in(xs, st, x_rows, cols, grp, G: gl.constexpr, HB: gl.constexpr):
    """cp.async group grp's activation halves [BM, HB] into stage st (one commit group)."""
    async_copy.async_copy_global_to_shared(xs.index(2 * st), x_rows + (cols + grp * G))
    async_copy.async_copy_global_to_shared(xs.index(2 * st + 1), x_rows + (cols + grp * G + HB))
    async_copy.commit_group()


@gluon.jit
def _stage_sums(xsum_ptr, row0, M, NG: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr):
    """Rows row0.. 's group sums (fp32 [M, NG], `group_sums`) into shared memory as [NG, 1, BM]: loaded
    once a program, then read a group at a time in the accumulator's column layout."""
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
    m = gl.minimum(row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, L)), M - 1)
    at = xsum_ptr + m[None, :].to(gl.int64) * NG
    sums = gl.allocate_shared_memory(gl.float32, [NG, 1, BM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for g in gl.static_range(NG):
        sums.index(g).store(gl.load(at + g))
    return sums


@gluon.jit
def _group(
    acc, ahead, grp, q_e, q_offs, sz_e, stride_sg, xs, x_rows, cols, sums, NG: gl.constexpr,
    G: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
    mma: gl.constexpr,
):  # fmt: skip
    """Group grp. `ahead` holds the (weight words, scale/zero words) of groups grp .. grp + AHEAD - 1,
    oldest first: group grp + AHEAD's are fetched, this group's tiles awaited and the stage after
    next issued, then two wgmma into a zeroed partial sum and acc += (512 s) * part - (s z) * sum(x)."""
    HB: gl.constexpr = G // 2
    A: gl.constexpr = gl.DotOperandLayout(0, mma, 4)
    nxt = gl.minimum(grp + AHEAD, NG - 1)  # the last prefetches re-read the last group
    fresh = (gl.load(q_e + (q_offs + nxt * (4 * HB))), gl.load(sz_e + nxt * stride_sg))
    qw, sz = ahead[0]
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()  # this thread's cp.async writes made visible to wgmma's (async proxy) reads
    gl.thread_barrier()  # every thread's: this group's tiles are in; the oldest stage is free
    _stage_in(xs, (grp + STAGES - 1) % STAGES, x_rows, cols, gl.minimum(grp + STAGES - 1, NG - 1), G, HB)
    lo, hi = _operands(qw, BN, HB, A)
    cur = grp % STAGES
    part = warpgroup_mma(
        lo, xs.index(2 * cur).permute((1, 0)), gl.zeros([BN, BM], gl.float32, mma), use_acc=False
    )
    part = warpgroup_mma(hi, xs.index(2 * cur + 1).permute((1, 0)), part)
    s = (sz << 16).to(gl.float32, bitcast=True)
    sb = s * (sz & -65536).to(gl.float32, bitcast=True)  # scale * zero
    acc = acc + (512.0 * s)[:, None] * part - sb[:, None] * sums.index(grp).load(mma)
    if AHEAD == 1:
        return acc, (fresh,)
    else:
        return acc, (ahead[1], fresh)


@gluon.jit
def _main_loop(
    q_e, q_offs, sz_e, stride_sg, xs, x_rows, cols, sums, NG: gl.constexpr, G: gl.constexpr,
    BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr, mma: gl.constexpr,
):  # fmt: skip
    """The groups: each one's activation halves staged STAGES - 1 ahead by cp.async, its weight and
    scale/zero words AHEAD (1 or 2) groups ahead in registers. Two groups an iteration, so those
    registers rotate by renaming, not by moves."""
    for st in gl.static_range(STAGES - 1):
        _stage_in(xs, st, x_rows, cols, st, G, G // 2)
    ahead = ((gl.load(q_e + q_offs), gl.load(sz_e)),)
    if AHEAD == 2:
        second = (gl.load(q_e + (q_offs + 2 * G)), gl.load(sz_e + stride_sg))
        ahead = (ahead[0], second)  # type: ignore[assignment]  # one length per AHEAD, fixed at trace time
    acc = gl.zeros([BN, BM], gl.float32, mma)
    for it in range(NG // 2):
        for u in gl.static_range(2):
            acc, ahead = _group(
                acc, ahead, 2 * it + u, q_e, q_offs, sz_e, stride_sg, xs, x_rows, cols, sums,
                NG, G, BN, BM, STAGES, AHEAD, mma,
            )  # fmt: skip
    if NG % 2 == 1:
        acc, ahead = _group(
            acc, ahead, NG - 1, q_e, q_offs, sz_e, stride_sg, xs, x_rows, cols, sums,
            NG, G, BN, BM, STAGES, AHEAD, mma,
        )  # fmt: skip
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _w4a8_wgmma_kernel(
    x_ptr, xs_ptr, xsum_ptr, q_ptr, sz_ptr, offs_ptr, out_ptr, M, N,
    stride_xm, stride_qe, stride_se, stride_sg, stride_om,
    K: gl.constexpr, G: gl.constexpr, E: gl.constexpr, E_POW2: gl.constexpr, BM: gl.constexpr,
    BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """One program: BM rows of one expert (row tile program_id(0)) x BN columns (program_id(1))."""
    _pdl_enter(PDL)
    HB: gl.constexpr = G // 2
    NG: gl.constexpr = K // G
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 32]
    )
    LQ: gl.constexpr = _word_layout(BN, HB, NW)
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HB, HB // 16], [NW, 1], [1, 0])
    SX: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HB, element_bitwidth=8, rank=2)
    expert, row0, end, live = _my_rows(offs_ptr, gl.program_id(0), E, E_POW2, BM, NW)
    if live:
        n0 = gl.program_id(1) * BN
        # the weight words of group 0: [BN/16, 32, HB/8], 4 * HB words a 16-row tile and group
        ti = gl.arange(0, BN // 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, LQ)))
        li = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LQ)))
        wi = gl.arange(0, HB // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))
        q_offs = (
            ((n0 // 16 + ti) * (NG * 4 * HB))[:, None, None]
            + (li * (HB // 8))[None, :, None]
            + wi[None, None, :]
        )
        # the activation rows: past the expert's end (or M) a row reads its neighbour or the last row, not stored
        mx = gl.arange(0, BM, layout=gl.SliceLayout(1, LX))
        x_rows = x_ptr + (gl.minimum(row0 + mx, M - 1).to(gl.int64) * stride_xm)[:, None]
        cols = gl.arange(0, HB, layout=gl.SliceLayout(0, LX))[None, :]
        xs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, BM, HB], SX)
        # the scale/zero words of columns n (the accumulator's rows); each row's group sums, staged once
        n_acc = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        m_acc = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        sz_e = sz_ptr + (expert * stride_se + n_acc)
        sums = _stage_sums(xsum_ptr, row0, M, NG, BM, NW)
        acc = _main_loop(
            q_ptr + expert.to(gl.int64) * stride_qe, q_offs, sz_e, stride_sg, xs, x_rows, cols, sums,
            NG, G, BN, BM, STAGES, AHEAD, mma,
        )  # fmt: skip
        y = acc * gl.load(xs_ptr + gl.minimum(m_acc, M - 1))[None, :]
        keep = (m_acc < end)[None, :] & (n_acc < N)[:, None]
        at = out_ptr + m_acc.to(gl.int64)[None, :] * stride_om + n_acc[:, None]
        gl.store(at, y.to(out_ptr.dtype.element_ty), mask=keep)


def w4a8_wgmma(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    sums: torch.Tensor,
    q8: torch.Tensor,
    sz8: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    tiles: tuple[int, ...] = (64, 64, 4, 3, 1),
) -> torch.Tensor:
    """`w4a8.w4a8_grouped`'s bias form on Hopper: x [M, K] e4m3 (rows in expert order), x_scale [M]
    fp32, sums [M, K/G] fp32 (`group_sums`), q8 the pack in `tile_q8`'s order [E, N/16, K/G, 8G] uint8,
    sz8 its scale/zero words [E, K/G, N] int32 (`pack_scale_zero8`), offs [E] int32 (each expert's
    end) -> [M, N] in out_dtype. Rows past offs[-1] are left unwritten. `tiles`: block_m, block_n,
    warps, stages and groups fetched ahead (1 if left out; `SWEEP_TILES`)."""
    from .._dispatch import pdl_kwargs

    block_m, block_n, warps, stages, ahead = (*tiles, 1)[:5]

    m, k = x.shape
    n_experts, n16, ng, lane_bytes = q8.shape
    n, group = 16 * n16, k // ng
    assert lane_bytes == 8 * group and k == ng * group and group in (64, 128), (q8.shape, k)
    assert n % block_n == 0 and block_n % (16 * warps) == 0, (n, block_n, warps)
    assert x.stride(1) == 1 and sums.shape == (m, ng) and sums.is_contiguous(), (x.stride(), sums.shape)
    assert sz8.shape == (n_experts, ng, n) and sz8.stride(2) == 1 and q8.is_contiguous(), sz8.shape
    assert 1 < stages <= ng + 1 and ahead in (1, 2) and ahead <= ng, (stages, ahead, ng)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    grid = (-(-m // block_m) + n_experts, n // block_n)
    _w4a8_wgmma_kernel[grid](
        x, x_scale, sums, q8.view(torch.int32), sz8, offs, out, m, n,
        x.stride(0), q8.stride(0) // 4, sz8.stride(0), sz8.stride(1), out.stride(0),
        K=k, G=group, E=n_experts, E_POW2=1 << (n_experts - 1).bit_length(), BM=block_m, BN=block_n,
        NW=warps, STAGES=stages, AHEAD=ahead, num_warps=warps, **pdl_kwargs(x_scale, _w4a8_wgmma_kernel),
    )  # fmt: skip
    return out


# the tilings the sweep times (benchmarks/kernels/fp8_grouped.py): block_m, block_n, warps, stages,
# groups of weight words fetched ahead
SWEEP_TILES = (
    (64, 64, 4, 2, 1),
    (64, 64, 4, 2, 2),
    (64, 64, 4, 3, 1),
    (64, 64, 4, 3, 2),
    (64, 64, 4, 4, 1),
    (32, 64, 4, 3, 1),
    (64, 128, 8, 3, 1),
    (128, 64, 4, 3, 1),
    (128, 128, 8, 3, 1),
)


def compile_specs():
    """Both GEMMs at the real shape (H 2,816, I 704, 128 experts; groups 128 and 64) at every sweep
    tiling: a layout conversion that stops being trivial (`assert_trivial`) or a lowering that leaves
    wgmma fails this on CPU (benchmarks/kernels/compile_check.py)."""
    from ..compile_spec import CompileSpec, pointers_and_strides

    types = {"x_ptr": "*fp8e4nv", "q_ptr": "*i32", "sz_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*fp32"}
    types |= {"offs_ptr": "*i32"}
    for (name, k, group), (bm, bn, warps, stages, ahead) in itertools.product(
        (("gate_up", 2816, 128), ("down", 704, 64)), SWEEP_TILES
    ):
        tile = {"BM": bm, "BN": bn, "NW": warps, "STAGES": stages, "AHEAD": ahead}
        yield CompileSpec(
            f"w4a8_wgmma_{name}_m{bm}n{bn}w{warps}s{stages}a{ahead}",
            _w4a8_wgmma_kernel,
            {"K": k, "G": group, "E": 128, "E_POW2": 128} | tile,
            types=types,
            divisible=pointers_and_strides(_w4a8_wgmma_kernel, "N"),
            num_warps=warps,
        )
