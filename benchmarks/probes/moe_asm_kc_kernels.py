"""Probe kernels (2026-11-30, session 6): the W4 MoE pair on a K-contiguous packing (q [E, N, Kp/2]) with
the nibbles turned into bf16 by inline PTX, four bytes per call (prmt + lop3 on 32-bit words, the
0x4300 magic exponent), so the MMA operand is loaded from shared memory as words, not bytes."""

import triton
import triton.language as tl

from canvasq.kernels.moe.kernels import _gelu_tanh, _zero_bias


@triton.jit
def nibbles_bf16(q):
    """q uint8 (any shape) -> (128 + low nibble, 128 + high nibble) as bf16, exact."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t01, t23, s01, s23;
        prmt.b32 t01, $4, 0, 0x4140;
        prmt.b32 t23, $4, 0, 0x4342;
        shr.u32 s01, t01, 4;
        shr.u32 s23, t23, 4;
        lop3.b32 $0, t01, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, t23, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $2, s01, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $3, s23, 0x000F000F, 0x43004300, 0xEA;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[q],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def gate_up_asm(
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
    H,
    I,
    stride_xt,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_hm,
    GROUP: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FOLD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    aid = tl.load(sorted_ids_ptr + rows)
    valid = aid < num_assign
    tok = aid // top_k
    HALF: tl.constexpr = GROUP // 2
    offs_k = tl.arange(0, HALF)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    x_off = tok[:, None] * stride_xt + offs_k[None, :]
    q_e = q_ptr + e.to(tl.int64) * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]  # [BLOCK_N, G/2], up rows at + I
    s_e = s_ptr + e.to(tl.int64) * stride_se
    z_e = z_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(NUM_GROUPS):
        k0 = g * GROUP
        xa = tl.load(x_ptr + (x_off + k0), mask=valid[:, None], other=0.0)
        xb = tl.load(x_ptr + (x_off + (k0 + HALF)), mask=valid[:, None], other=0.0)
        qg = tl.trans(tl.load(q_e + (q_off + g * HALF), mask=n_mask[:, None], other=0))
        qu = tl.trans(tl.load(q_e + (q_off + (g * HALF + I * stride_qn)), mask=n_mask[:, None], other=0))
        srow = g * stride_sg
        sg = tl.load(s_e + (offs_n + srow), mask=n_mask, other=0.0).to(tl.float32)
        su = tl.load(s_e + (offs_n + (srow + I)), mask=n_mask, other=0.0).to(tl.float32)
        zg = _zero_bias(tl.load(z_e + (offs_n + srow), mask=n_mask, other=0.0), tl.bfloat16, 2)
        zu = _zero_bias(tl.load(z_e + (offs_n + (srow + I)), mask=n_mask, other=0.0), tl.bfloat16, 2)
        glo, ghi = nibbles_bf16(qg)
        ulo, uhi = nibbles_bf16(qu)
        if FOLD:  # x @ (128 + q) - rowsum(x) * (128 + z): no per-weight subtract
            rs = tl.sum(xa.to(tl.float32), 1) + tl.sum(xb.to(tl.float32), 1)
            pg = tl.dot(xb, ghi, tl.dot(xa, glo))
            pu = tl.dot(xb, uhi, tl.dot(xa, ulo))
            acc_g += (pg - rs[:, None] * zg.to(tl.float32)[None, :]) * sg[None, :]
            acc_u += (pu - rs[:, None] * zu.to(tl.float32)[None, :]) * su[None, :]
        else:
            pg = tl.dot(xa, glo - zg[None, :])
            pg = tl.dot(xb, ghi - zg[None, :], pg)
            pu = tl.dot(xa, ulo - zu[None, :])
            pu = tl.dot(xb, uhi - zu[None, :], pu)
            acc_g += pg * sg[None, :]
            acc_u += pu * su[None, :]
    h = _gelu_tanh(acc_g) * acc_u
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=n_mask[None, :],
    )


@triton.jit
def down_asm(
    h_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assign,
    H,
    I,
    stride_hm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_ym,
    GROUP: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FOLD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    aid = tl.load(sorted_ids_ptr + rows)
    valid = aid < num_assign
    HALF: tl.constexpr = GROUP // 2
    offs_k = tl.arange(0, HALF)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    h_off = rows[:, None] * stride_hm + offs_k[None, :]
    q_e = q_ptr + e * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]
    s_e = s_ptr + e * stride_se
    z_e = z_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(NUM_GROUPS):
        k0 = g * GROUP
        ha = tl.load(h_ptr + (h_off + k0), mask=valid[:, None], other=0.0)
        hb = tl.load(h_ptr + (h_off + (k0 + HALF)), mask=valid[:, None], other=0.0)
        q = tl.trans(tl.load(q_e + (q_off + g * HALF), mask=n_mask[:, None], other=0))
        s = tl.load(s_e + (offs_n + g * stride_sg), mask=n_mask, other=0.0).to(tl.float32)
        z = _zero_bias(tl.load(z_e + (offs_n + g * stride_sg), mask=n_mask, other=0.0), tl.bfloat16, 2)
        lo, hi = nibbles_bf16(q)
        if FOLD:
            rs = tl.sum(ha.to(tl.float32), 1) + tl.sum(hb.to(tl.float32), 1)
            p = tl.dot(hb, hi, tl.dot(ha, lo))
            acc += (p - rs[:, None] * z.to(tl.float32)[None, :]) * s[None, :]
        else:
            p = tl.dot(ha, lo - z[None, :])
            p = tl.dot(hb, hi - z[None, :], p)
            acc += p * s[None, :]
    tl.store(
        y_ptr + aid[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )
