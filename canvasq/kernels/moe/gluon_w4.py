"""W4A16 MoE matmuls in Gluon, Triton's layout-explicit dialect: GPU only (sm_80+, compiled; the CPU
interpreter cannot run Gluon, so CPU CI checks the k order and the PTX in torch and compiles the
kernels for sm_90; the GPU tests run them against the Triton kernels and the dequantised twin).

Why a second pair of kernels: the Triton ones (`kernels.py`) leave the register layout of the MMA
operands to the compiler, which re-pairs the dequantised weights and the activations with about 75
moves and 42 `prmt` per iteration (BENCHMARKS.md, session 6). Here the layouts are spelled out:

- swap-AB: the weights are the MMA's A operand (rows = output columns n, 16 per `mma.m16n8k16`) and
  the activations its B operand (the BLOCK_M sorted rows of one expert, 8 per MMA column tile);
- both operands use `DotOperandLayout(k_width=8)`, whose logical k we are free to assign to real k
  as long as both sides agree (`mma_k`). The assignment below makes every 32-bit word of the
  K-contiguous packing (`quant.py`, unchanged: no second copy of the experts) dequantise straight into
  four A registers, and every MMA's two B registers two adjacent activation pairs, so neither side
  needs a register move;
- the weight and activation tiles of a group come in by cp.async through STAGES shared-memory buffers
  while earlier groups are multiplied; the zero point is subtracted in the dequantisation's PTX and
  the scale multiplies each group's fp32 partial product, as in the Triton kernels.

Letters as in `kernels.py`; HB = G/2 packed bytes per row per group; NH = G/32 words a lane loads per
row per group; BN = 16 * warps * tiles rows per program.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Four packed bytes (k = j..j+3 in the low nibbles, HB + j..j+3 in the high ones) -> $0 = (j, j+1),
# $1 = (j+2, j+3), $2 = (HB+j, HB+j+1), $3 = (HB+j+2, HB+j+3) as DT pairs of q - zero. prmt spreads
# bytes 0,1 (2,3) into the low bytes of the two halves; lop3 0xEA is (a & b) | c: keep one nibble per
# half and OR in the magic exponent (value magic + q); one fma with 1.0 adds the row's -(magic + zero)
# ($5, both halves), exactly: q - zero is a small integer.
_WORD_PTX = """
{
.reg .b32 one, t01, t23, s01, s23, a, b, c, d;
mov.b32 one, ONE;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shr.u32 s01, t01, 4;
shr.u32 s23, t23, 4;
lop3.b32 a, t01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 b, t23, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c, s01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 d, s23, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $0, a, one, $5;
fma.rn.TY $1, b, one, $5;
fma.rn.TY $2, c, one, $5;
fma.rn.TY $3, d, one, $5;
}
"""
WORD_PTX_BF16 = _WORD_PTX.replace("MAGIC", "0x43004300").replace("TY", "bf16x2").replace("ONE", "0x3F803F80")
WORD_PTX_FP16 = _WORD_PTX.replace("MAGIC", "0x64006400").replace("TY", "f16x2").replace("ONE", "0x3C003C00")
_WORD_PTX_BF16: gl.constexpr = gl.constexpr(WORD_PTX_BF16)
_WORD_PTX_FP16: gl.constexpr = gl.constexpr(WORD_PTX_FP16)


def mma_k(group: int) -> torch.Tensor:
    """Real k (column of the activations and the packed weights within a group) of each of the MMA's
    logical k, as pairs: logical pair L = 32b + 16h + 4c + 2i + s is real pair s*G/4 + 2w + h, where
    w = NH*c + 2b + i is the word of the row that lane c loads and s, h pick one of its four PTX
    outputs ($s*2 + h). In Triton's k_width = 8 order one `mma.m16n8k16` takes, per lane c, logical
    pairs 32b + 4c + i' and 32b + 16 + 4c + i' (i' = 2i + s): real pairs 2w + s*G/4 and that + 1, side
    by side, and the two A registers of the same word."""
    L = torch.arange(group // 2)
    b, h, c, i, s = L // 32, (L // 16) % 2, (L // 4) % 4, (L // 2) % 2, L % 2
    w = (group // 32) * c + 2 * b + i
    m = s * (group // 4) + 2 * w + h
    return torch.stack([2 * m, 2 * m + 1], dim=-1).reshape(group)


@gluon.constexpr_function
def _word_layout(BN, G, NW):
    """Layout of a [BN, G/8] int32 tile of packed words: lane 4g + c holds words NH*c .. NH*c + NH - 1
    of rows g and g + 8 (one vector load each); warps stacked along rows, then further row tiles."""
    nh = G // 32
    reg = [[0, 1 << i] for i in range(nh.bit_length() - 1)] + [[8, 0]]
    rows = 16 * NW
    while rows < BN:
        reg.append([rows, 0])
        rows *= 2
    lanes = [[0, nh], [0, 2 * nh], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(NW.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lanes, warps, [], [BN, G // 8])


@gluon.constexpr_function
def _act_layout(BM, G, NW):
    """Layout of a [BM, G/2] int32 tile of activation pairs (real order) that `_act_tile` turns into
    the MMA's B operand [G, BM] by renaming registers: lane 4g + c holds real pairs 2NH*c .. + 2NH - 1
    of each half of the group (s = 0, 1) for rows g, g + 8, ..."""
    nh = G // 32
    reg = [[0, 1 << i] for i in range(nh.bit_length())] + [[0, G // 4]]
    rows = 8
    while rows < BM:
        reg.append([rows, 0])
        rows *= 2
    lanes = [[0, 2 * nh], [0, 4 * nh], [1, 0], [2, 0], [4, 0]]
    warps = [[0, 0]] * (NW.bit_length() - 1)
    return gl.DistributedLinearLayout(reg, lanes, warps, [], [BM, G // 2])


@gluon.constexpr_function
def _copy_layout(BM, G, NW):
    """A coalesced layout for copying the [BM, G/2] int32 activation tile: 16 bytes a lane."""
    return gl.BlockedLayout([1, 4], [32 * 4 // (G // 2), G // 2 // 4], [NW, 1], [1, 0])


@gluon.jit
def _halves(p, DT: gl.constexpr):
    """int32 [R, W] of DT pairs -> DT [R, 2W] (low half first)."""
    h = gl.join(p.to(gl.int16), (p >> 16).to(gl.int16))
    return gl.reshape(h, [p.shape[0], 2 * p.shape[1]]).to(DT, bitcast=True)


@gluon.jit
def _act_tile(pairs, DT: gl.constexpr, B8: gl.constexpr):
    """int32 [BM, G/2] activation pairs in real order -> the MMA's B operand [G, BM] in DT (logical
    order, `mma_k`)."""
    BM: gl.constexpr = pairs.shape[0]
    W: gl.constexpr = pairs.shape[1]
    NB: gl.constexpr = W // 32  # 64-k blocks: 2 for G = 128, 1 (and no b) for G = 64
    if NB == 2:
        p = gl.reshape(pairs, [BM, 2, 4, 2, 2, 2])  # real pair = s, c, b, i, h (NH = 4: w = 4c + 2b + i)
        p = gl.permute(p, [0, 3, 5, 2, 4, 1])  # logical = b, h, c, i, s
    else:
        p = gl.reshape(pairs, [BM, 2, 4, 2, 2])  # real pair = s, c, i, h (NH = 2: w = 2c + i)
        p = gl.permute(p, [0, 4, 2, 3, 1])  # logical = h, c, i, s
    x = _halves(gl.reshape(p, [BM, W]), DT)
    return gl.convert_layout(gl.permute(x, [1, 0]), B8, assert_trivial=True)


@gluon.jit
def _dequant(qw, nz, DT: gl.constexpr, A8: gl.constexpr):
    """Packed words [BN, G/8] (real order) and each row's -(magic + zero) as a DT pair [BN] int32 ->
    the weights (q - zero) [BN, G] in the MMA's A layout, logical order (`mma_k`)."""
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
    r = gl.join(gl.join(r0, r2), gl.join(r1, r3))  # [BN, W, s, h]: output 2s + h
    if W == 16:
        p = gl.reshape(r, [BN, 4, 2, 2, 2, 2])  # w = 4c + 2b + i, then s, h
        p = gl.permute(p, [0, 2, 5, 1, 3, 4])  # logical = b, h, c, i, s
    else:
        p = gl.reshape(r, [BN, 4, 2, 2, 2])  # w = 2c + i, then s, h
        p = gl.permute(p, [0, 4, 1, 2, 3])  # logical = h, c, i, s
    w = _halves(gl.reshape(p, [BN, 4 * W]), DT)
    return gl.convert_layout(w, A8, assert_trivial=True)


@gluon.jit
def _neg_zero(z, DT: gl.constexpr):
    """zero [BN] (DT, integer values) -> -(magic + zero) in DT, both halves of an int32."""
    if DT == gl.bfloat16:
        v = (-(z.to(gl.float32) + 128.0)).to(DT)
    else:
        v = (-(z.to(gl.float32) + 1024.0)).to(DT)
    h = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return h | (h << 16)


@gluon.jit
def _q_offsets(n0, stride_qn, BN: gl.constexpr, G: gl.constexpr, LW: gl.constexpr):
    """int32 word offsets [BN, G/8] of rows n0.. in group 0 (add grp * G/8)."""
    NH: gl.constexpr = G // 32
    r = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    w = gl.arange(0, G // 8, layout=gl.SliceLayout(0, LW))
    off = r[:, None] * stride_qn + w[None, :]
    return gl.max_contiguous(gl.multiple_of(off, [1, NH]), [1, NH])  # rows are 16-byte aligned


@gluon.jit
def _stage_in(sws, q_offs, sx, st, grp, q_e, xw_ptr, x_cp, x_cp_mask, G: gl.constexpr):
    """Issue the cp.async copies of group `grp`'s weight tiles (one per matrix: buffers `sws`, offsets
    `q_offs`) and activation tile into stage `st` of the [STAGES, ...] buffers, as one commit group."""
    for i in gl.static_range(len(sws)):
        async_copy.async_copy_global_to_shared(sws[i].index(st), q_e + (q_offs[i] + grp * (G // 8)))
    async_copy.async_copy_global_to_shared(sx.index(st), xw_ptr + (x_cp + grp * (G // 2)), mask=x_cp_mask)
    async_copy.commit_group()


@gluon.jit
def _group_mma(acc, qw, xb, s_e, z_e, srow, rz, rs, DT: gl.constexpr, A8: gl.constexpr):
    """acc += ((q - zero) @ x) * scale over one group: rows rz/rs (offsets of this matrix's scale and
    zero, in two layouts), qw [BN, G/8] packed words, xb the B operand [G, BM]."""
    nz = _neg_zero(gl.load(z_e + srow + rz), DT)
    sc = gl.load(s_e + srow + rs).to(gl.float32)
    p = mma_v2(_dequant(qw, nz, DT, A8), xb, gl.zeros_like(acc))
    return acc + p * sc[:, None]


@gluon.jit
def _matmul_groups(
    sws,
    q_offs,
    sx,
    q_e,
    xw_ptr,
    x_cp,
    x_cp_mask,
    s_e,
    z_e,
    stride_sg,
    row_shift,
    rz,
    rs,
    BN: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP: gl.constexpr,
    NUM_GROUPS: gl.constexpr,
    STAGES: gl.constexpr,
    NW: gl.constexpr,
    DT: gl.constexpr,
):
    """The pipelined main loop: one fp32 accumulator [BN, BLOCK_M] per matrix (1 or 2; matrix i's
    scale/zero rows are shifted by i * row_shift)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A8: gl.constexpr = gl.DotOperandLayout(0, mma, 8)
    B8: gl.constexpr = gl.DotOperandLayout(1, mma, 8)
    LW: gl.constexpr = _word_layout(BN, GROUP, NW)
    LX: gl.constexpr = _act_layout(BLOCK_M, GROUP, NW)
    for st in gl.static_range(STAGES - 1):
        _stage_in(sws, q_offs, sx, st, st, q_e, xw_ptr, x_cp, x_cp_mask, GROUP)
    acc0 = gl.zeros([BN, BLOCK_M], gl.float32, mma)
    acc1 = gl.zeros([BN, BLOCK_M], gl.float32, mma)
    for grp in range(NUM_GROUPS):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # group grp landed for every thread; stage (grp - 1) % STAGES is free again
        nxt = gl.minimum(grp + STAGES - 1, NUM_GROUPS - 1)  # past the end: a harmless re-read
        _stage_in(sws, q_offs, sx, (grp + STAGES - 1) % STAGES, nxt, q_e, xw_ptr, x_cp, x_cp_mask, GROUP)
        cur = grp % STAGES
        xb = _act_tile(sx.index(cur).load(LX), DT, B8)
        srow = grp * stride_sg
        acc0 = _group_mma(acc0, sws[0].index(cur).load(LW), xb, s_e, z_e, srow, rz, rs, DT, A8)
        if len(sws) == 2:
            w1 = sws[1].index(cur).load(LW)
            acc1 = _group_mma(acc1, w1, xb, s_e, z_e, srow + row_shift, rz, rs, DT, A8)
    async_copy.wait_group(0)
    return acc0, acc1


@gluon.jit
def _gl_w4_gate_up_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    h_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assign,
    top_k,
    I,
    stride_xt,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_hm,
    GROUP: gl.constexpr,
    NUM_GROUPS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BN: gl.constexpr,
    NW: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program: BLOCK_M sorted rows of one expert x BN columns of I, gate and up together;
    h = act(gate) * up. q_ptr: the packed bytes as int32 words (strides in words)."""
    DT: gl.constexpr = x_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    LW: gl.constexpr = _word_layout(BN, GROUP, NW)
    LC: gl.constexpr = _copy_layout(BLOCK_M, GROUP, NW)
    SW: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [1, 0])  # lanes read 512 contiguous bytes
    SX: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])  # 16-byte vectors xor-ed by row
    pid_m = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)

    xw_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    mc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LC))
    aid = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + mc)
    valid = aid < num_assign
    kc = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, LC))
    x_cp = gl.where(valid, aid // top_k, 0)[:, None] * (stride_xt // 2) + kc[None, :]
    x_cp_mask = valid[:, None] & (kc[None, :] < GROUP)

    q_offs = (_q_offsets(n0, stride_qn, BN, GROUP, LW), _q_offsets(n0 + I, stride_qn, BN, GROUP, LW))
    sws = (
        gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),
        gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),
    )
    sx = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, GROUP // 2], SX)
    rz = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    rs = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    acc_g, acc_u = _matmul_groups(
        sws, q_offs, sx, q_ptr + e * stride_qe, xw_ptr, x_cp, x_cp_mask, s_ptr + e * stride_se,
        z_ptr + e * stride_se, stride_sg, I, rz, rs, BN, BLOCK_M, GROUP, NUM_GROUPS, STAGES, NW, DT,
    )  # fmt: skip

    # gelu_pytorch_tanh(gate) * up (kernels._gelu_tanh), stored transposed: h[row, n]
    u = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
    hv = acc_g / (1.0 + gl.exp(-2.0 * u)) * acc_u
    mrow = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    gl.store(h_ptr + mrow[None, :].to(gl.int64) * stride_hm + rs[:, None], hv.to(h_ptr.dtype.element_ty))


@gluon.jit
def _gl_w4_down_kernel(
    h_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assign,
    stride_hm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_ym,
    GROUP: gl.constexpr,
    NUM_GROUPS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BN: gl.constexpr,
    NW: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program: BLOCK_M sorted rows x BN columns of H; writes rows y_tk[t*K + k] (unweighted)."""
    DT: gl.constexpr = h_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    LW: gl.constexpr = _word_layout(BN, GROUP, NW)
    LC: gl.constexpr = _copy_layout(BLOCK_M, GROUP, NW)
    SW: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [1, 0])
    SX: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    pid_m = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)

    hw_ptr = h_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    mc = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LC))
    kc = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, LC))
    h_cp = mc[:, None] * (stride_hm // 2) + kc[None, :]

    q_offs = (_q_offsets(n0, stride_qn, BN, GROUP, LW),)
    sws = (gl.allocate_shared_memory(gl.int32, [STAGES, BN, GROUP // 8], SW),)
    sx = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, GROUP // 2], SX)
    rz = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    rs = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    acc, _ = _matmul_groups(
        sws, q_offs, sx, q_ptr + e * stride_qe, hw_ptr, h_cp, None, s_ptr + e * stride_se,
        z_ptr + e * stride_se, stride_sg, 0, rz, rs, BN, BLOCK_M, GROUP, NUM_GROUPS, STAGES, NW, DT,
    )  # fmt: skip

    mo = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    aid = gl.load(sorted_ids_ptr + mo)
    gl.store(
        y_ptr + aid[None, :].to(gl.int64) * stride_ym + rs[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=(aid < num_assign)[None, :] & (rs < 1 << 30)[:, None],
    )
