"""Triton kernels of the grouped W4A16 MoE (launchers and the public function live in `launch.py`).

Letters: T tokens, K experts per token (top-k), A = T*K assignments, P padded assignment rows (a
multiple of BLOCK_M), E experts, H hidden width, I expert width, G quantisation group.
Routing metadata (built in `launch.align_routing`): `sorted_ids [P] int32` holds assignment ids
t*K + k grouped by expert, each expert's run padded to a multiple of BLOCK_M with the sentinel A;
`block_expert [P/BLOCK_M] int32` is the expert of each BLOCK_M-row block; `num_padded [1] int32` is P
(blocks at or past it exit at once: the grid is sized by an upper bound so no host sync is needed).

Flow: x [T, H] --gate_up (+act)--> h [P, I] --down--> y_tk [A, H] --combine (fixed k order)--> y [T, H].
No atomics anywhere: every output element is written by exactly one program, so reruns are bit-identical.
"""

import triton
import triton.language as tl

from .._math import pdl_enter


@triton.jit
def _gelu_tanh(x):
    # gelu_pytorch_tanh: 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


# DEQUANT modes: 1/2/3 (fp16/bf16/fp32 operands) OR the nibble into the mantissa of a float whose exponent makes one ulp == 1 (1024.0 / 128.0 / 2^23),
# so the conversion is one OR and the offset folds into the zero point: q - z == magic(q) - (z + M).
# 4/5 (fp16/bf16, compiled for a GPU only: the interpreter runs no PTX) give mode 1/2's values from
# inline PTX on 32-bit words: four bytes -> eight weights in two prmt, two shifts and four lop3.
@triton.jit
def _zero_bias(z, DT: tl.constexpr, DEQUANT: tl.constexpr):
    if DEQUANT == 1 or DEQUANT == 4:
        return (z.to(tl.float32) + 1024.0).to(DT)
    elif DEQUANT == 2 or DEQUANT == 5:
        return (z.to(tl.float32) + 128.0).to(DT)
    else:
        return z.to(tl.float32) + 8388608.0


@triton.jit
def _nibble(v, DT: tl.constexpr, DEQUANT: tl.constexpr):
    """v: uint8 values 0..15 -> DT plus the mode's magic offset; modes 1-3."""
    if DEQUANT == 1:
        return (v.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    elif DEQUANT == 2:
        return (v.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    else:
        return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)


# prmt spreads bytes 0,1 (2,3) of a word into the low bytes of its two halves; lop3 0xEA is (a & b) | c:
# keep one nibble per half and OR in the magic exponent (0x6400: fp16 1024, 0x4300: bf16 128)
_NIBBLES_PTX = """
{
.reg .b32 t01, t23, s01, s23;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shr.u32 s01, t01, 4;
shr.u32 s23, t23, 4;
lop3.b32 $0, t01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $1, t23, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $2, s01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $3, s23, 0x000F000F, MAGIC, 0xEA;
}
"""
_NIBBLES_FP16: tl.constexpr = tl.constexpr(_NIBBLES_PTX.replace("MAGIC", "0x64006400"))
_NIBBLES_BF16: tl.constexpr = tl.constexpr(_NIBBLES_PTX.replace("MAGIC", "0x43004300"))


@triton.jit
def _nibbles(q, DT: tl.constexpr, DEQUANT: tl.constexpr):
    """Packed bytes q (uint8, any shape) -> (low nibbles, high nibbles) in DT, plus the mode's offset."""
    if DEQUANT == 4:
        return tl.inline_asm_elementwise(
            _NIBBLES_FP16, "=r,=r,=r,=r,r", [q], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    elif DEQUANT == 5:
        return tl.inline_asm_elementwise(
            _NIBBLES_BF16, "=r,=r,=r,=r,r", [q], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        return _nibble(q & 0xF, DT, DEQUANT), _nibble(q >> 4, DT, DEQUANT)


@triton.jit
def _act_halves(ptr, off, k0, offs_k, valid, width, HALF: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation rows' two halves of a group, [rows, G/2] at k0 and k0 + G/2 (the operands of the
    low and the high nibbles). EVEN_K: no group runs past `width`, so the row mask alone (the K mask
    cost down ~20 % at 8 rows)."""
    if EVEN_K:
        ma = valid[:, None]
        mb = ma
    else:
        ma = valid[:, None] & (k0 + offs_k[None, :] < width)
        mb = valid[:, None] & (k0 + HALF + offs_k[None, :] < width)
    return tl.load(ptr + (off + k0), mask=ma, other=0.0), tl.load(
        ptr + (off + (k0 + HALF)), mask=mb, other=0.0
    )


@triton.jit
def _w4_gate_up_kernel(
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
    DOT_PREC: tl.constexpr,
    DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M sorted rows (one expert) x BLOCK_N columns of I, gate and up together; one
    group per iteration (G/2 packed rows: k and k + G/2)."""
    pdl_enter(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
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

    # Scalar base pointers + int32 offset tiles: 64-bit pointer tiles held across the loop cost two
    # registers per element and make this kernel spill (255 regs at BLOCK_N=64, 4 warps).
    x_off = tok[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, G/2]
    q_e = q_ptr + e.to(tl.int64) * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]  # [BLOCK_N, G/2] bytes, up rows at + I
    s_e = s_ptr + e.to(tl.int64) * stride_se
    z_e = z_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(NUM_GROUPS):  # constexpr trip count (also dodges an interpreter bug)
        k0 = g * GROUP
        xa, xb = _act_halves(x_ptr, x_off, k0, offs_k, valid, H, HALF, EVEN_K)
        qcol = g * HALF
        qg = tl.trans(tl.load(q_e + (q_off + qcol), mask=n_mask[:, None], other=0))  # [G/2, BLOCK_N]
        qu = tl.trans(tl.load(q_e + (q_off + (qcol + I * stride_qn)), mask=n_mask[:, None], other=0))
        srow = g * stride_sg
        sg = tl.load(s_e + (offs_n + srow), mask=n_mask, other=0.0).to(tl.float32)
        su = tl.load(s_e + (offs_n + (srow + I)), mask=n_mask, other=0.0).to(tl.float32)
        zg = _zero_bias(tl.load(z_e + (offs_n + srow), mask=n_mask, other=0.0), DT, DEQUANT)
        zu = _zero_bias(tl.load(z_e + (offs_n + (srow + I)), mask=n_mask, other=0.0), DT, DEQUANT)
        qg_lo, qg_hi = _nibbles(qg, DT, DEQUANT)
        qu_lo, qu_hi = _nibbles(qu, DT, DEQUANT)
        # (q - zero) is an exact small integer in any float dtype; the scale is constant over the group,
        # so it multiplies the [BLOCK_M, BLOCK_N] partial product instead of the [G, BLOCK_N] tile.
        wg_lo = qg_lo - zg[None, :]
        wg_hi = qg_hi - zg[None, :]
        wu_lo = qu_lo - zu[None, :]
        wu_hi = qu_hi - zu[None, :]
        pg = tl.dot(xa, wg_lo.to(DT), input_precision=DOT_PREC)
        pg = tl.dot(xb, wg_hi.to(DT), pg, input_precision=DOT_PREC)
        pu = tl.dot(xa, wu_lo.to(DT), input_precision=DOT_PREC)
        pu = tl.dot(xb, wu_hi.to(DT), pu, input_precision=DOT_PREC)
        acc_g += pg * sg[None, :]
        acc_u += pu * su[None, :]
    # activation folded into the epilogue: h = act(gate) * up, never stored separately
    h = _gelu_tanh(acc_g) * acc_u
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=n_mask[None, :],
    )


@triton.jit
def _w4_down_kernel(
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
    DOT_PREC: tl.constexpr,
    DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M sorted rows x BLOCK_N columns of H, one group per iteration; writes rows
    y_tk[t*K + k]."""
    pdl_enter(PDL)
    DT: tl.constexpr = h_ptr.dtype.element_ty
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

    h_off = rows[:, None] * stride_hm + offs_k[None, :]  # int32 offset tiles, scalar bases (see above)
    q_e = q_ptr + e * stride_qe
    q_off = offs_n[:, None] * stride_qn + offs_k[None, :]  # [BLOCK_N, G/2] bytes
    s_e = s_ptr + e * stride_se
    z_e = z_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(NUM_GROUPS):  # constexpr trip count (also dodges an interpreter bug)
        k0 = g * GROUP
        ha, hb = _act_halves(h_ptr, h_off, k0, offs_k, valid, I, HALF, EVEN_K)
        q = tl.trans(tl.load(q_e + (q_off + g * HALF), mask=n_mask[:, None], other=0))
        s = tl.load(s_e + (offs_n + g * stride_sg), mask=n_mask, other=0.0).to(tl.float32)
        z = _zero_bias(tl.load(z_e + (offs_n + g * stride_sg), mask=n_mask, other=0.0), DT, DEQUANT)
        q_lo, q_hi = _nibbles(q, DT, DEQUANT)
        w_lo = q_lo - z[None, :]  # exact, scaled after the dot: see the gate_up kernel
        w_hi = q_hi - z[None, :]
        p = tl.dot(ha, w_lo.to(DT), input_precision=DOT_PREC)
        p = tl.dot(hb, w_hi.to(DT), p, input_precision=DOT_PREC)
        acc += p * s[None, :]
    tl.store(
        y_ptr + aid[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


@triton.jit
def _combine_kernel(
    y_tk_ptr,
    w_ptr,
    ids_ptr,
    scale_ptr,
    out_ptr,
    H,
    stride_ym,
    stride_ot,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = `combine_row` over columns offs of program_id(1)'s block."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < H
    acc = combine_row(
        y_tk_ptr, w_ptr, ids_ptr, scale_ptr, ids_ptr, t, offs, mask, stride_ym, TOP_K, K_P2, RENORM, False
    )
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_row(
    y_tk_ptr, w_ptr, ids_ptr, scale_ptr, map_ptr, t, offs, mask, stride_ym, TOP_K: tl.constexpr,
    K_P2: tl.constexpr, RENORM: tl.constexpr, ROW_MAP: tl.constexpr,
):  # fmt: skip
    """sum_k w[t, k] * y_tk[t*K + k, offs] (fp32 [len(offs)]), k in fixed order 0..K-1, fp32
    accumulation; ROW_MAP: row map[t*K + k] of y_tk instead (rows left in expert order). RENORM
    (DiffusionGemma's router epilogue, otherwise three torch ops per layer): w are
    the raw top-k probabilities, used as w[t, k] / sum_k w[t, k] * scale[ids[t, k]] (correctly rounded
    divide). Shared by `_combine_kernel` and the end-of-layer norm that takes the rows unreduced
    (`norm_residual.add_rms_norm` with `ExpertRows`)."""
    # the K weights and source rows as vectors first, so the K row loads go out together instead of one
    # dependent round trip to memory each (a scalar taken out of a vector: a select and a warp reduction)
    ks = tl.arange(0, K_P2)
    kin = ks < TOP_K
    wv = tl.load(w_ptr + t * TOP_K + ks, mask=kin, other=0.0).to(tl.float32)
    if RENORM:
        e = tl.load(ids_ptr + t * TOP_K + ks, mask=kin, other=0)
        es = tl.load(scale_ptr + e, mask=kin, other=0.0).to(tl.float32)
        wv = tl.math.div_rn(wv, tl.sum(wv, 0)) * es
    src = tl.load(map_ptr + t * TOP_K + ks, mask=kin, other=0).to(tl.int64) if ROW_MAP else t * TOP_K + ks
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        w = tl.sum(tl.where(ks == k, wv, 0.0), 0)
        v = tl.load(y_tk_ptr + tl.sum(tl.where(ks == k, src, 0), 0) * stride_ym + offs, mask=mask, other=0.0)
        acc = tl.fma(w, v.to(tl.float32), acc)  # explicit: the same in kernels compiled without contraction
    return acc


@triton.jit
def _onehot_rank(ids_ptr, i, num_assign, running, ex, SUB: tl.constexpr):
    """For assignments i [SUB]: one-hot over experts [SUB, E_P2], each one's slot `running[e] + rank
    among the earlier of those SUB with the same expert`, and the updated running counts."""
    e_i = tl.load(ids_ptr + i, mask=i < num_assign, other=-1).to(tl.int32)
    hit = (ex[None, :] == e_i[:, None]).to(tl.int32)  # [SUB, E_P2]; -1 (past the end) hits nothing
    before = tl.cumsum(hit, 0) - hit  # earlier rows of the same expert within these SUB
    dest = tl.sum(hit * (before + running[None, :]), 1)
    return dest, running + tl.sum(hit, 0)


@triton.jit
def _histogram_kernel(
    ids_ptr,
    hist_ptr,
    num_assign,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """hist[c, e] = assignments of chunk c (CHUNK consecutive ids t*K + k) routed to expert e."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    ex = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), tl.int32)
    # a loop, not unrolled: static_range over 64 tiles (chunks of 2,048: past 65,536 assignments) takes
    # 143 s to compile for sm_90 and spills 8 KB of stack (the align kernel: 419 s, 768 B), so a
    # worker's first batch past 8,192 tokens at top-8 would stall for minutes
    for s in range(CHUNK // SUB):
        i = c * CHUNK + s * SUB + tl.arange(0, SUB)
        _, counts = _onehot_rank(ids_ptr, i, num_assign, counts, ex, SUB)
    tl.store(hist_ptr + c * E_P2 + ex, counts)


@triton.jit
def _align_kernel(
    ids_ptr,
    hist_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    counts_ptr,
    num_assign,
    num_experts,
    num_chunks,
    p_max,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    HIST_ROWS: tl.constexpr,
    HIST_STEPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Routing metadata from the flat expert ids and the per-chunk histograms: a counting sort, no
    atomics, no global sort. Every program sums the histograms (counts per expert, and the counts of
    the chunks before its own) and then, SUB at a time, owns CHUNK assignments (writes each one's padded slot: its
    expert's run start + assignments of that expert in earlier chunks + rank within its chunk, so
    the order within an expert is assignment order), CHUNK padded rows (writes the sentinel where no
    assignment lands: disjoint from the first set, so no ordering between programs) and the
    CHUNK / BLOCK_M blocks of those rows.
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    ex = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), tl.int32)
    earlier = tl.zeros((E_P2,), tl.int32)
    # HIST_STEPS = cdiv(num_chunks, HIST_ROWS), a constexpr trip count (a runtime one trips the interpreter)
    for step in tl.static_range(HIST_STEPS):
        ch = step * HIST_ROWS + tl.arange(0, HIST_ROWS)
        h = tl.load(hist_ptr + ch[:, None] * E_P2 + ex[None, :], mask=ch[:, None] < num_chunks, other=0)
        counts += tl.sum(h, 0)
        earlier += tl.sum(tl.where(ch[:, None] < pid, h, 0), 0)
    counts = tl.where(ex < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
        tl.store(counts_ptr + ex, counts, mask=ex < num_experts)

    running = pad_start + earlier  # next free slot of each expert for this chunk's assignments
    for s in range(CHUNK // SUB):  # a loop, not unrolled (see the histogram kernel)
        i = pid * CHUNK + s * SUB + tl.arange(0, SUB)
        dest, running = _onehot_rank(ids_ptr, i, num_assign, running, ex, SUB)
        tl.store(sorted_ids_ptr + dest, i, mask=i < num_assign)

        # padding rows: row r belongs to expert #(experts whose padded run ends at or before r)
        r = i
        e_r = tl.sum((pad_end[None, :] <= r[:, None]).to(tl.int32), 1)
        own = ex[None, :] == e_r[:, None]
        local = r - tl.sum(tl.where(own, pad_start[None, :], 0), 1)
        cnt = tl.sum(tl.where(own, counts[None, :], 0), 1)
        pad = (e_r >= num_experts) | (local >= cnt)
        tl.store(sorted_ids_ptr + r, tl.zeros_like(r) + num_assign, mask=(r < p_max) & pad)

        # blocks of those rows (SUB is a multiple of BLOCK_M)
        b = (pid * CHUNK + s * SUB) // BLOCK_M + tl.arange(0, SUB // BLOCK_M)
        e_b = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + b, tl.minimum(e_b, num_experts - 1), mask=b * BLOCK_M < p_max)


def compile_specs(cfg=None, hidden: int = 2816, inter: int = 704):
    """The two matmuls at `cfg`'s Triton tiles (default: `MoeLaunchConfig()`), bf16 as compiled for a GPU,
    then the combine and the routing kernels at two chunk sizes: 256 assignments (2,048 tokens at
    top-8) and 2,048 (past 8,192 tokens, where an unrolled chunk loop compiled for minutes and spilled)
    (benchmarks/kernels/compile_check.py)."""
    import torch

    from ..compile_spec import CompileSpec, pointers_and_strides
    from .config import MoeLaunchConfig, triton_constexprs

    cfg = cfg or MoeLaunchConfig()
    routing = {"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
    for which, group, width in (("gate_up", 128, hidden), ("down", 64, inter)):
        fn = _w4_gate_up_kernel if which == "gate_up" else _w4_down_kernel
        consts = triton_constexprs(which, cfg, group, width // group, width, torch.bfloat16, compiled=True)
        yield CompileSpec(
            which,
            fn,
            consts,
            types={"q_ptr": "*u8", **routing},
            divisible=pointers_and_strides(fn, "H", "I", "num_assign"),
            num_warps=getattr(cfg, f"{which}_warps"),
            num_stages=getattr(cfg, f"{which}_stages"),
        )
    yield CompileSpec(
        "combine",
        _combine_kernel,
        {"TOP_K": 8, "K_P2": 8, "RENORM": True, "BLOCK_N": 1024},
        types={"w_ptr": "*fp32", "ids_ptr": "*i64"},
        divisible=frozenset({"y_tk_ptr", "out_ptr", "H", "stride_ym", "stride_ot"}),
    )
    for chunk in (256, 2048):
        consts = {"E_P2": 128, "CHUNK": chunk, "SUB": 32}
        types = {"ids_ptr": "*i64", "hist_ptr": "*i32", **routing, "counts_ptr": "*i32"}
        yield CompileSpec(f"histogram_chunk{chunk}", _histogram_kernel, consts, types)
        consts = {**consts, "BLOCK_M": 16, "HIST_ROWS": 16, "HIST_STEPS": 4}
        yield CompileSpec(f"align_chunk{chunk}", _align_kernel, consts, types)
    # the FP8 experts' order by counting (`model.fp8.expert_order`'s "count"): one-row blocks, 4,096
    # tokens at top-8
    consts = {"E_P2": 128, "CHUNK": 512, "SUB": 32, "BLOCK_M": 1, "HIST_ROWS": 16, "HIST_STEPS": 4}
    yield CompileSpec("align_rows", _align_kernel, consts, types)
