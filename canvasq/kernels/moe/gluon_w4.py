"""W4A16 MoE matmuls in Gluon, Triton's layout-explicit dialect: GPU only (sm_80+, compiled; the CPU
interpreter cannot run Gluon, so CPU CI checks the tiling, the k order and the PTX in torch and
compiles the kernels for sm_90; the GPU tests run them against the Triton kernels and the twin).

Why a second pair of kernels: the Triton ones (`kernels.py`) leave the register layout of the MMA
operands to the compiler, which re-pairs the dequantised weights and the activations with about 75
moves and 42 `prmt` per iteration. Here the layouts are spelled out:

- swap-AB: the weights are the MMA's A operand (rows = output columns n, 16 per `mma.m16n8k16`) and
  the activations its B operand (the BLOCK_M sorted rows of one expert, 8 per MMA column tile);
- both operands use `DotOperandLayout(k_width=8)`, whose logical k are assigned to real k (`mma_k`) so
  that each MMA's two activation registers are adjacent pairs in memory: one 16-byte load gives them;
- the packed bytes are re-tiled (`gluon_pack.tile_q`, a permutation of `quant.py`'s bytes) so that
  one 32-bit word holds the 8 logical k of one lane's A registers and a warp's load is contiguous; one
  PTX block per word gives those registers with the zero point subtracted (the tiles' register
  layouts: `gluon_layouts.py`);
- two main loops: the next group's tiles wait in registers (STAGES = 0, `_loop_registers`), or come
  in by cp.async through STAGES shared-memory buffers (`_loop_staged`);
- each group's scale and zero are one int32 word per row (`gluon_pack.pack_scale_zero`), loaded two
  groups before their use: loaded right before it, they stall every group on DRAM.

On CUDA the runtime keeps the experts in the tiled order only (`W4Experts.to_tiled`,
`launch.prefer_tiled`), so these kernels are what a GPU worker runs; the Triton ones serve K-contiguous
packs (CPU/interpreter, fp32, padded widths, CANVASQ_MOE_LAYOUT=kcontig). Tiles per row count:
MoeLaunchConfig.gluon_*. The tiled copy is what makes a warp's weight loads contiguous (512 bytes);
read in place, the K-contiguous bytes come 8 rows x 64 bytes at a time and lose that bandwidth.

Letters as in `kernels.py`; HB = G/2 packed bytes per row per group; BN = 16 * warps * tiles rows.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_layouts import act_layout, act_load_layout, word_layout
from .gluon_pack import WORD_PTX_BF16, WORD_PTX_FP16

_WORD_PTX_BF16: gl.constexpr = gl.constexpr(WORD_PTX_BF16)
_WORD_PTX_FP16: gl.constexpr = gl.constexpr(WORD_PTX_FP16)


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    """`canvasq.kernels._math.pdl_enter` for Gluon kernels (the same two PTX instructions)."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _q_offsets(n0, BN: gl.constexpr, G: gl.constexpr, NG: gl.constexpr, LW: gl.constexpr):
    """int32 word offsets [BN, G/8] of rows n0.. in group 0's tiles (`tile_q`; add grp * 2G)."""
    NH: gl.constexpr = G // 32
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    p = gl.arange(0, G // 8, layout=gl.SliceLayout(0, LW))
    row = (n0 // 16 + r // 16) * (NG * 2 * G) + ((r % 16) // 8) * (32 * NH) + (r % 8) * (4 * NH)
    return row[:, None] + p[None, :]


@gluon.jit
def _halves(p, DT: gl.constexpr):
    """int32 [BN, W] of DT pairs -> DT [BN, 2W] (low half first)."""
    h = gl.join(p.to(gl.int16), (p >> 16).to(gl.int16))
    return gl.reshape(h, [p.shape[0], 2 * p.shape[1]]).to(DT, bitcast=True)


@gluon.jit
def _act_tile(pairs, DT: gl.constexpr, B8: gl.constexpr):
    """int32 [BM, G/2] activation pairs in real order -> the MMA's B operand [G, BM] in DT, logical
    order (`mma_k`: real pair 32b + 8c + 2i + h is logical 32b + 16h + 4c + i)."""
    BM: gl.constexpr = pairs.shape[0]
    W: gl.constexpr = pairs.shape[1]
    p = gl.reshape(pairs, [BM, W // 32, 4, 4, 2])  # b, c, i, h
    p = gl.reshape(gl.permute(p, [0, 1, 4, 2, 3]), [BM, W])  # b, h, c, i
    return gl.convert_layout(gl.permute(_halves(p, DT), [1, 0]), B8, assert_trivial=True)


@gluon.jit
def _dequant(qw, nz, DT: gl.constexpr, A8: gl.constexpr):
    """Packed words [BN, G/8] and each row's -(magic + zero) as a DT pair [BN] int32 -> the weights
    (q - zero) [BN, G] in the MMA's A layout (k in the group's order: no register moves)."""
    BN: gl.constexpr = qw.shape[0]
    W: gl.constexpr = qw.shape[1]
    zz = gl.broadcast(nz[:, None], qw)[0]
    if DT == gl.bfloat16:
        r0, r1, r2, r3 = gl.inline_asm_elementwise(
            _WORD_PTX_BF16, "=r,=r,=r,=r,r,r", [qw, zz], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    else:
        r0, r1, r2, r3 = gl.inline_asm_elementwise(
            _WORD_PTX_FP16, "=r,=r,=r,=r,r,r", [qw, zz], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    pairs = gl.reshape(gl.join(gl.join(r0, r2), gl.join(r1, r3)), [BN, 4 * W])  # pair 2a + b = r_{2a+b}
    w = _halves(pairs, DT)  # [BN, 8W], k_phys = 8p + kin, p = c*NH + h
    w = gl.reshape(gl.permute(gl.reshape(w, [BN, 4, W // 4, 8]), [0, 2, 1, 3]), [BN, 8 * W])
    return gl.convert_layout(w, A8, assert_trivial=True)


@gluon.jit
def _load_sz(sz_e, srow, rz):
    """The packed scale/zero words [BN] of rows rz (offsets of this matrix's rows) in one group."""
    return gl.load(sz_e + srow + rz)


@gluon.jit
def _stage_in(sws, q_offs, sx, st, grp, q_e, xw_ptr, x_cp, x_cp_mask, G: gl.constexpr):
    """Issue the cp.async copies of group `grp`'s weight tiles (one per matrix: buffers `sws`, offsets
    `q_offs`) and activation tile into stage `st` of the [STAGES, ...] buffers, as one commit group."""
    for i in gl.static_range(len(sws)):
        async_copy.async_copy_global_to_shared(sws[i].index(st), q_e + (q_offs[i] + grp * 2 * G))
    async_copy.async_copy_global_to_shared(sx.index(st), xw_ptr + (x_cp + grp * (G // 2)), mask=x_cp_mask)
    async_copy.commit_group()


@gluon.jit
def _group_mma(acc, qw, xb, sz, DT: gl.constexpr, A8: gl.constexpr):
    """acc += ((q - zero) @ x) * scale over one group: qw [BN, G/8] packed words, xb the B operand
    [G, BM], sz the rows' packed scale/zero words (`pack_scale_zero`, loaded groups ahead)."""
    hi = (sz >> 16) & 0xFFFF
    p = mma_v2(_dequant(qw, hi | (hi << 16), DT, A8), xb, gl.zeros_like(acc))
    if DT == gl.bfloat16:
        sc = (sz << 16).to(gl.float32, bitcast=True)
    else:
        sc = (sz & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    sc = gl.convert_layout(sc, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)
    return acc + p * sc[:, None]


@gluon.jit
def _act_offsets(
    sorted_ids_ptr, pid_m, num_assign, top_k, stride_t, BLOCK_M: gl.constexpr, GROUP: gl.constexpr,
    L: gl.constexpr,
):  # fmt: skip
    """gate_up's activations: int32-pair offsets [BLOCK_M, G/2] (layout L) of group 0 of each sorted
    assignment's token row, and their mask (padding rows masked, and pointed at row 0)."""
    m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
    kk = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, L))
    aid = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + m)
    valid = aid < num_assign
    off = gl.where(valid, aid // top_k, 0)[:, None] * (stride_t // 2) + kk[None, :]
    return off, valid[:, None] & (kk[None, :] < GROUP)


@gluon.jit
def _row_offsets(pid_m, stride_t, BLOCK_M: gl.constexpr, GROUP: gl.constexpr, L: gl.constexpr):
    """down's activations: int32-pair offsets [BLOCK_M, G/2] (layout L) of group 0 of the sorted rows."""
    m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
    kk = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, L))
    return m[:, None] * (stride_t // 2) + kk[None, :]


@gluon.jit
def _load_pairs(ptr, mask):
    if mask is None:
        return gl.load(ptr)
    else:
        return gl.load(ptr, mask=mask, other=0)


@gluon.jit
def _group_step(
    acc0, acc1, w0, w1, pairs, sz0, sz1, NMAT: gl.constexpr, DT: gl.constexpr, A8: gl.constexpr,
    B8: gl.constexpr,
):  # fmt: skip
    """One group of every matrix (1: down; 2: gate, then up), scale/zero words sz0 / sz1."""
    xb = _act_tile(pairs, DT, B8)
    acc0 = _group_mma(acc0, w0, xb, sz0, DT, A8)
    if NMAT == 2:
        acc1 = _group_mma(acc1, w1, xb, sz1, DT, A8)
    return acc0, acc1


@gluon.jit
def _load_sz2(sz_e, grp, stride_sg, shift1, rz, NMAT: gl.constexpr):
    """Both matrices' scale/zero words of group `grp` (the second: rows shifted by shift1)."""
    a = _load_sz(sz_e, grp * stride_sg, rz)
    b = a
    if NMAT == 2:
        b = _load_sz(sz_e, grp * stride_sg + shift1, rz)
    return a, b


@gluon.jit
def _loop_registers(
    acc0, acc1, q_e, q_off0, q_off1, act_ptr, act_off, act_mask, sz_e, stride_sg, shift1, rz,
    NMAT: gl.constexpr, GROUP: gl.constexpr, NUM_GROUPS: gl.constexpr, DT: gl.constexpr,
    A8: gl.constexpr, B8: gl.constexpr,
):  # fmt: skip
    """The main loop with the next group's tiles waiting in registers: two groups per iteration,
    ping-pong (group g + 1's tiles load while g multiplies, and g + 2's reuse g's registers; a
    one-group loop moved every prefetched register once per iteration). The scale/zero words are
    loaded two groups ahead (they come from DRAM on first touch: a load right before its use left
    every group waiting on it)."""
    TILE_W: gl.constexpr = 2 * GROUP  # words of one 16-row tile's group
    HALF: gl.constexpr = GROUP // 2
    w0 = gl.load(q_e + q_off0)
    w1 = w0
    if NMAT == 2:
        w1 = gl.load(q_e + q_off1)
    xt = _load_pairs(act_ptr + act_off, act_mask)
    sa0, sa1 = _load_sz2(sz_e, 0, stride_sg, shift1, rz, NMAT)
    sb0, sb1 = _load_sz2(sz_e, gl.minimum(1, NUM_GROUPS - 1), stride_sg, shift1, rz, NMAT)
    for it in range(NUM_GROUPS // 2):
        g0 = 2 * it
        sc0, sc1 = _load_sz2(sz_e, gl.minimum(g0 + 2, NUM_GROUPS - 1), stride_sg, shift1, rz, NMAT)
        sd0, sd1 = _load_sz2(sz_e, gl.minimum(g0 + 3, NUM_GROUPS - 1), stride_sg, shift1, rz, NMAT)
        w0n = gl.load(q_e + (q_off0 + (g0 + 1) * TILE_W))
        if NMAT == 2:
            w1n = gl.load(q_e + (q_off1 + (g0 + 1) * TILE_W))
        else:
            w1n = w1
        xtn = _load_pairs(act_ptr + (act_off + (g0 + 1) * HALF), act_mask)
        acc0, acc1 = _group_step(acc0, acc1, w0, w1, xt, sa0, sa1, NMAT, DT, A8, B8)
        g2 = gl.minimum(g0 + 2, NUM_GROUPS - 1)  # the last prefetch re-reads the last group
        w0 = gl.load(q_e + (q_off0 + g2 * TILE_W))
        if NMAT == 2:
            w1 = gl.load(q_e + (q_off1 + g2 * TILE_W))
        xt = _load_pairs(act_ptr + (act_off + g2 * HALF), act_mask)
        acc0, acc1 = _group_step(acc0, acc1, w0n, w1n, xtn, sb0, sb1, NMAT, DT, A8, B8)
        sa0, sa1, sb0, sb1 = sc0, sc1, sd0, sd1
    if NUM_GROUPS % 2 == 1:
        acc0, acc1 = _group_step(acc0, acc1, w0, w1, xt, sa0, sa1, NMAT, DT, A8, B8)
    return acc0, acc1


@gluon.jit
def _loop_staged(
    acc0, acc1, q_e, q_off0, q_off1, act_ptr, act_off, act_mask, sz_e, stride_sg, shift1, rz,
    NMAT: gl.constexpr, GROUP: gl.constexpr, NUM_GROUPS: gl.constexpr, DT: gl.constexpr,
    A8: gl.constexpr, B8: gl.constexpr, BN: gl.constexpr, BLOCK_M: gl.constexpr, NW: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """The main loop with the weight and activation tiles brought in by cp.async through STAGES
    shared-memory buffers: only the current group is held in registers (and the scale/zero words of
    the next two, loaded ahead as in `_loop_registers`)."""
    LW: gl.constexpr = word_layout(BN, GROUP, NW)
    LX: gl.constexpr = act_layout(BLOCK_M, GROUP, NW)
    SW: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [1, 0])  # lanes read 512 contiguous bytes
    SX: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])  # 16-byte vectors xor-ed by row
    if NMAT == 2:
        q_offs = (q_off0, q_off1)
        sws = (
            gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),
            gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),
        )
    else:
        q_offs = (q_off0,)  # type: ignore[assignment]  # one tuple length per NMAT, fixed at trace time
        sws = (gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),)  # type: ignore[assignment]
    sx = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, GROUP // 2], SX)

    for st in gl.static_range(STAGES - 1):
        _stage_in(sws, q_offs, sx, st, st, q_e, act_ptr, act_off, act_mask, GROUP)
    sa0, sa1 = _load_sz2(sz_e, 0, stride_sg, shift1, rz, NMAT)
    sb0, sb1 = _load_sz2(sz_e, gl.minimum(1, NUM_GROUPS - 1), stride_sg, shift1, rz, NMAT)
    for grp in range(NUM_GROUPS):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # group grp landed for every thread; stage (grp - 1) % STAGES is free again
        nxt = gl.minimum(grp + STAGES - 1, NUM_GROUPS - 1)  # past the end: a harmless re-read
        ns = (grp + STAGES - 1) % STAGES
        _stage_in(sws, q_offs, sx, ns, nxt, q_e, act_ptr, act_off, act_mask, GROUP)
        sc0, sc1 = _load_sz2(sz_e, gl.minimum(grp + 2, NUM_GROUPS - 1), stride_sg, shift1, rz, NMAT)
        pairs, w0, w1 = _stage_frags(sws, sx, grp % STAGES, LW, LX, NMAT)
        acc0, acc1 = _group_step(acc0, acc1, w0, w1, pairs, sa0, sa1, NMAT, DT, A8, B8)
        sa0, sa1, sb0, sb1 = sb0, sb1, sc0, sc1
    async_copy.wait_group(0)
    return acc0, acc1


@gluon.jit
def _main_loop(
    acc0, acc1, q_e, q_off0, q_off1, act_ptr, act_off, act_mask, sz_e, stride_sg, shift1, rz,
    NMAT: gl.constexpr, GROUP: gl.constexpr, NUM_GROUPS: gl.constexpr, DT: gl.constexpr,
    A8: gl.constexpr, B8: gl.constexpr, BN: gl.constexpr, BLOCK_M: gl.constexpr, NW: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """Both kernels' main loop over the groups: `_loop_registers` (STAGES 0) or `_loop_staged`."""
    if STAGES == 0:
        return _loop_registers(
            acc0, acc1, q_e, q_off0, q_off1, act_ptr, act_off, act_mask, sz_e, stride_sg, shift1, rz,
            NMAT, GROUP, NUM_GROUPS, DT, A8, B8,
        )  # fmt: skip
    else:
        return _loop_staged(
            acc0, acc1, q_e, q_off0, q_off1, act_ptr, act_off, act_mask, sz_e, stride_sg, shift1, rz,
            NMAT, GROUP, NUM_GROUPS, DT, A8, B8, BN, BLOCK_M, NW, STAGES,
        )  # fmt: skip


@gluon.jit
def _stage_frags(sws, sx, st, LW: gl.constexpr, LX: gl.constexpr, NMAT: gl.constexpr):
    """Stage st's activation pairs and weight words, from shared memory into registers."""
    pairs = sx.index(st).load(LX)
    w0 = sws[0].index(st).load(LW)
    w1 = w0
    if NMAT == 2:
        w1 = sws[1].index(st).load(LW)
    return pairs, w0, w1


@gluon.jit
def _gl_w4_gate_up_kernel(
    x_ptr,
    qt_ptr,
    sz_ptr,
    h_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assign,
    top_k,
    I,
    stride_xt,
    stride_qe,
    stride_se,
    stride_sg,
    stride_hm,
    GROUP: gl.constexpr,
    NUM_GROUPS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BN: gl.constexpr,
    NW: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
):
    """One program: BLOCK_M sorted rows of one expert x BN columns of I, gate and up together;
    h = act(gate) * up. qt_ptr: int32 words of `tile_q`'s layout (stride_qe in words); sz_ptr: int32
    words of `pack_scale_zero` [E, ng, 2I] (strides stride_se, stride_sg). STAGES: 0 for the register
    main loop, >= 2 for the cp.async one."""
    _pdl_enter(PDL)
    DT: gl.constexpr = x_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A8: gl.constexpr = gl.DotOperandLayout(0, mma, 8)
    B8: gl.constexpr = gl.DotOperandLayout(1, mma, 8)
    LW: gl.constexpr = word_layout(BN, GROUP, NW)
    LA: gl.constexpr = act_load_layout(BLOCK_M, GROUP, NW, STAGES)
    pid_m = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)

    xw_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)  # activations as int32 pairs
    x_off, x_mask = _act_offsets(sorted_ids_ptr, pid_m, num_assign, top_k, stride_xt, BLOCK_M, GROUP, LA)
    q_off_g = _q_offsets(n0, BN, GROUP, NUM_GROUPS, LW)
    q_off_u = _q_offsets(n0 + I, BN, GROUP, NUM_GROUPS, LW)
    rz = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    rs = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    q_e = qt_ptr + e * stride_qe
    sz_e = sz_ptr + e * stride_se
    acc_g = gl.zeros([BN, BLOCK_M], gl.float32, mma)
    acc_u = gl.zeros([BN, BLOCK_M], gl.float32, mma)
    acc_g, acc_u = _main_loop(
        acc_g, acc_u, q_e, q_off_g, q_off_u, xw_ptr, x_off, x_mask, sz_e, stride_sg, I, rz,
        2, GROUP, NUM_GROUPS, DT, A8, B8, BN, BLOCK_M, NW, STAGES,
    )  # fmt: skip

    # gelu_pytorch_tanh(gate) * up (kernels._gelu_tanh), stored transposed: h[row, n]
    u = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
    hv = acc_g / (1.0 + gl.exp(-2.0 * u)) * acc_u
    mrow = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    gl.store(h_ptr + mrow[None, :].to(gl.int64) * stride_hm + rs[:, None], hv.to(h_ptr.dtype.element_ty))


@gluon.jit
def _gl_w4_down_kernel(
    h_ptr,
    qt_ptr,
    sz_ptr,
    y_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assign,
    stride_hm,
    stride_qe,
    stride_se,
    stride_sg,
    stride_ym,
    GROUP: gl.constexpr,
    NUM_GROUPS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BN: gl.constexpr,
    NW: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
):
    """One program: BLOCK_M sorted rows x BN columns of H; writes rows y_tk[t*K + k] (unweighted).
    STAGES: as in the gate_up kernel."""
    _pdl_enter(PDL)
    DT: gl.constexpr = h_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A8: gl.constexpr = gl.DotOperandLayout(0, mma, 8)
    B8: gl.constexpr = gl.DotOperandLayout(1, mma, 8)
    LW: gl.constexpr = word_layout(BN, GROUP, NW)
    LA: gl.constexpr = act_load_layout(BLOCK_M, GROUP, NW, STAGES)
    pid_m = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)

    hw_ptr = h_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    h_off = _row_offsets(pid_m, stride_hm, BLOCK_M, GROUP, LA)
    q_off = _q_offsets(n0, BN, GROUP, NUM_GROUPS, LW)
    rz = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    rs = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    q_e = qt_ptr + e * stride_qe
    sz_e = sz_ptr + e * stride_se
    acc = gl.zeros([BN, BLOCK_M], gl.float32, mma)
    acc, _ = _main_loop(
        acc, acc, q_e, q_off, q_off, hw_ptr, h_off, None, sz_e, stride_sg, 0, rz,
        1, GROUP, NUM_GROUPS, DT, A8, B8, BN, BLOCK_M, NW, STAGES,
    )  # fmt: skip

    mc = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    aid = gl.load(sorted_ids_ptr + mc)
    gl.store(
        y_ptr + aid[None, :].to(gl.int64) * stride_ym + rs[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=(aid < num_assign)[None, :] & (rs < 1 << 30)[:, None],
    )


# tiles of the H200 configs that spill and were measured fastest anyway (bytes of stack allowed): the
# BLOCK_M 32 gate_up w2 t2 s3 (1,024-4,096 rows) and the 256-row down under its 72-register cap
MEASURED_SPILLS = {"gluon_gate_up m32 w2 t2 s3": 48, "gluon_down m16 w4 t2 s3 r72": 8}


def compile_specs(configs: dict | None = None):
    """Both kernels at every distinct Gluon tile of the real-shape H200 configs (what a CUDA worker runs
    on its tiled packs): a layout conversion that stops being trivial (`assert_trivial`) fails this on
    CPU (benchmarks/kernels/compile_check.py)."""
    from ..compile_spec import CompileSpec, pointers_and_strides
    from .config import CONFIG_DIR, config_file_name, load_configs

    name = config_file_name(128, 2816, 704, 8, torch.bfloat16, "NVIDIA_H200")
    ints = ("qt_ptr", "sz_ptr", "sorted_ids_ptr", "block_expert_ptr", "num_padded_ptr")
    specs = {}
    for cfg in (configs or load_configs(str(CONFIG_DIR / name))).values():
        for which, group, groups in (("gate_up", 128, 22), ("down", 64, 11)):
            w, t, st, mr = (
                getattr(cfg, f"gluon_{which}_{k}") for k in ("warps", "tiles", "stages", "maxnreg")
            )
            bm = cfg.gluon_block_m or cfg.block_m
            name = f"gluon_{which} m{bm} w{w} t{t} s{st}" + (f" r{mr}" if mr else "")
            fn = _gl_w4_gate_up_kernel if which == "gate_up" else _gl_w4_down_kernel
            consts = {
                "GROUP": group,
                "NUM_GROUPS": groups,
                "BLOCK_M": bm,
                "BN": 16 * w * t,
                "NW": w,
                "STAGES": st,
            }
            specs[name] = CompileSpec(
                name, fn, consts, dict.fromkeys(ints, "*i32"), pointers_and_strides(fn, "I"), num_warps=w,
                options={"maxnreg": mr} if mr else {}, spill_bytes=MEASURED_SPILLS.get(name, 0),
            )  # fmt: skip
    return specs.values()
