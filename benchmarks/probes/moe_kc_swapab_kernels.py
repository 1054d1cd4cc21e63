"""Probe kernels (not used by canvasq): K-contiguous W4 layout q [E, N, Kp/2] with swap-AB (weights as the MMA A operand)."""

import triton
import triton.language as tl

from canvasq.kernels.moe.kernels import _gelu_tanh, _nibble, _zero_bias


@triton.jit
def gate_up_kc(
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
    SWAP: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    DEQUANT: tl.constexpr = 2 if DT == tl.bfloat16 else 1
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
    offs_n = tl.where(n_mask, offs_n, 0)  # clamp: loads stay in bounds, the store is masked
    q_e = q_ptr + e.to(tl.int64) * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]
    s_e = s_ptr + e.to(tl.int64) * stride_se
    z_e = z_ptr + e.to(tl.int64) * stride_se
    if SWAP:
        x_off = tok[None, :] * stride_xt + offs_k[:, None]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_off = tok[:, None] * stride_xt + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(NUM_GROUPS):
        k0 = g * GROUP
        if SWAP:
            xa = tl.load(x_ptr + (x_off + k0), mask=valid[None, :], other=0.0)
            xb = tl.load(x_ptr + (x_off + (k0 + HALF)), mask=valid[None, :], other=0.0)
        else:
            xa = tl.load(x_ptr + (x_off + k0), mask=valid[:, None], other=0.0)
            xb = tl.load(x_ptr + (x_off + (k0 + HALF)), mask=valid[:, None], other=0.0)
        qg = tl.load(q_e + (q_off + g * HALF))
        qu = tl.load(q_e + (q_off + (g * HALF + I * stride_qn)))
        srow = g * stride_sg
        sg = tl.load(s_e + (offs_n + srow)).to(tl.float32)
        su = tl.load(s_e + (offs_n + (srow + I))).to(tl.float32)
        zg = _zero_bias(tl.load(z_e + (offs_n + srow)), DT, DEQUANT)
        zu = _zero_bias(tl.load(z_e + (offs_n + (srow + I))), DT, DEQUANT)
        wg_lo = _nibble(qg & 0xF, DT, DEQUANT) - zg[:, None]
        wg_hi = _nibble(qg >> 4, DT, DEQUANT) - zg[:, None]
        wu_lo = _nibble(qu & 0xF, DT, DEQUANT) - zu[:, None]
        wu_hi = _nibble(qu >> 4, DT, DEQUANT) - zu[:, None]
        if SWAP:
            pg = tl.dot(wg_lo, xa)
            pg = tl.dot(wg_hi, xb, pg)
            pu = tl.dot(wu_lo, xa)
            pu = tl.dot(wu_hi, xb, pu)
            acc_g += pg * sg[:, None]
            acc_u += pu * su[:, None]
        else:
            pg = tl.dot(xa, tl.trans(wg_lo))
            pg = tl.dot(xb, tl.trans(wg_hi), pg)
            pu = tl.dot(xa, tl.trans(wu_lo))
            pu = tl.dot(xb, tl.trans(wu_hi), pu)
            acc_g += pg * sg[None, :]
            acc_u += pu * su[None, :]
    h = _gelu_tanh(acc_g) * acc_u
    if SWAP:
        tl.store(
            h_ptr + rows[None, :].to(tl.int64) * stride_hm + offs_n[:, None], h.to(DT), mask=n_mask[:, None]
        )
    else:
        tl.store(
            h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(DT), mask=n_mask[None, :]
        )


@triton.jit
def down_kc(
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
):
    DT: tl.constexpr = h_ptr.dtype.element_ty
    DEQUANT: tl.constexpr = 2 if DT == tl.bfloat16 else 1
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
    h_off = rows[None, :] * stride_hm + offs_k[:, None]  # [HALF, BM]
    q_e = q_ptr + e * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]
    s_e = s_ptr + e * stride_se
    z_e = z_ptr + e * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(NUM_GROUPS):
        k0 = g * GROUP
        ha = tl.load(h_ptr + (h_off + k0), mask=valid[None, :], other=0.0)
        hb = tl.load(h_ptr + (h_off + (k0 + HALF)), mask=valid[None, :], other=0.0)
        q = tl.load(q_e + (q_off + g * HALF))
        s = tl.load(s_e + (offs_n + g * stride_sg)).to(tl.float32)
        z = _zero_bias(tl.load(z_e + (offs_n + g * stride_sg)), DT, DEQUANT)
        p = tl.dot(_nibble(q & 0xF, DT, DEQUANT) - z[:, None], ha)
        p = tl.dot(_nibble(q >> 4, DT, DEQUANT) - z[:, None], hb, p)
        acc += p * s[:, None]
    tl.store(y_ptr + aid[None, :].to(tl.int64) * stride_ym + offs_n[:, None], acc.to(DT), mask=valid[None, :])
