"""The runtime's attention: windows of query rows against their slots' arena entries, one launch that
writes the o_proj input directly.

`attend(q, k_arena, v_arena, slots, lmax, mask)`:
- q [B, kv, g*R, d]: the query rows with GQA folded in (the g query heads of a KV head as g*R rows,
  `Runtime`'s query layout);
- k_arena / v_arena [S, kv, C, d]: a layer's arena, read in place for the B slots `slots` (their first
  `lmax` entries: no gather copy when the slots are not consecutive);
- mask: None, or additive [B, 1, g*R, lmax] (0 / -inf; the band and block masks the runtime builds from
  stored positions);
- -> o [B*R, heads*d] with row b*R + r, columns of head kv*g + i, i.e. the layout o_proj reads
  (SDPA's [B, kv, g*R, d] output needed a transposing copy).

Scale 1 (DiffusionGemma normalises q and k instead). Online softmax in fp32 (exp2), P rounded to the
value dtype before the second product, as flash attention does; a row with every key masked (padding
rows) gives zeros, where SDPA gives NaN (the runtime drops those rows). The torch twin is SDPA on the
gathered arena slices.

Why: SDPA's fixed costs per call dominate short windows. On the H200 at the real shape the runtime
uses this kernel for windows of up to `SHORT_WINDOW` rows (8-row windows: 5.6-5.7 instead of 6.0-6.3 ms
per forward); for a full 256-row canvas it is no faster than cuDNN's flash kernel plus the copy, so
SDPA keeps that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._dispatch import auto_triton, interpreted, pdl_kwargs
from ._math import pdl_enter

LOG2E = tl.constexpr(1.4426950408889634)
SHORT_WINDOW = 64  # rows per window up to which the runtime attends through this kernel


@triton.jit
def _attend_block(
    q, k_base, v_base, mrow, start, L, sk_l, sv_l, live, m_i, l_i, acc, D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Keys start .. start + BLOCK_N: the online-softmax update of (row max, row sum, accumulator)."""
    cols_d = tl.arange(0, D)
    keys = start + tl.arange(0, BLOCK_N)
    kin = keys < L
    k = tl.load(k_base + keys[:, None].to(tl.int64) * sk_l + cols_d[None, :], mask=kin[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * LOG2E  # [BLOCK_M, BLOCK_N] fp32, base-2 logits
    if HAS_MASK:
        s += tl.load(mrow + keys[None, :], mask=live[:, None] & kin[None, :], other=0.0).to(tl.float32)
    s = tl.where(kin[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key masked so far: keep exp2 finite
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_l + cols_d[None, :], mask=kin[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    m_ptr,
    o_ptr,
    sq_b,
    sq_h,
    sq_r,
    sk_s,
    sk_h,
    sk_l,
    sv_s,
    sv_h,
    sv_l,
    sm_b,
    sm_r,
    so_r,
    R,
    GR,
    L,
    G,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET_STEPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M folded query rows of (window b, KV head kv) against the first L entries of
    slot slots[b]; writes o[b*R + r, (kv*G + i)*D + :] for folded row i*R + r."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < GR
    cols_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sq_b + kv * sq_h + rows[:, None].to(tl.int64) * sq_r + cols_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    slot = tl.load(slot_ptr + b).to(tl.int64)
    k_base = k_ptr + slot * sk_s + kv * sk_h
    v_base = v_ptr + slot * sv_s + kv * sv_h
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    mrow = m_ptr + b * sm_b + rows[:, None].to(tl.int64) * sm_r
    if INTERPRET_STEPS > 0:  # the CPU interpreter cannot run a loop of runtime length
        for it in tl.static_range(INTERPRET_STEPS):
            m_i, l_i, acc = _attend_block(
                q,
                k_base,
                v_base,
                mrow,
                it * BLOCK_N,
                L,
                sk_l,
                sv_l,
                live,
                m_i,
                l_i,
                acc,
                D,
                BLOCK_N,
                HAS_MASK,
                DOT_PREC,
            )
    else:
        for start in range(0, L, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q,
                k_base,
                v_base,
                mrow,
                start,
                L,
                sk_l,
                sv_l,
                live,
                m_i,
                l_i,
                acc,
                D,
                BLOCK_N,
                HAS_MASK,
                DOT_PREC,
            )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    head = kv * G + (rows // R)
    orow = b * R + (rows % R)
    tl.store(
        o_ptr + orow[:, None].to(tl.int64) * so_r + head[:, None] * D + cols_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=live[:, None],
    )


def _tiles(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): 32 x 32 tiles with 8 warps, spill-free for head dims 256 and
    512 on sm_90 (141 / 197 registers). Kernel by kernel the tile probe
    (`benchmarks/probes/attention_gpu_timing.py`) favours 64 x 64 / 16 x 32 tiles, but in the whole
    forward those make the 256-row window 1 ms slower."""
    return 32, 32, 8, 2


def attend_launch(
    q, k_arena, v_arena, slots, lmax: int, mask=None, groups: int = 1, tiles: tuple | None = None
) -> torch.Tensor:
    nb, kvh, gr, d = q.shape
    assert k_arena.shape[1] == v_arena.shape[1] == kvh and k_arena.shape[3] == v_arena.shape[3] == d
    assert q.stride(-1) == k_arena.stride(-1) == v_arena.stride(-1) == 1 and slots.shape == (nb,)
    assert d >= 16 and triton.next_power_of_2(d) == d and gr % groups == 0, (d, gr, groups)
    assert lmax <= k_arena.shape[2]
    g = groups
    r = gr // g
    o = torch.empty(nb * r, kvh * g * d, dtype=q.dtype, device=q.device)
    if mask is not None:
        assert mask.shape == (nb, 1, gr, lmax) and mask.stride(-1) == 1, mask.shape
    bm, bn, warps, stages = tiles or _tiles(d)
    if o.numel():
        _attend_kernel[(triton.cdiv(gr, bm), kvh, nb)](
            q,
            k_arena,
            v_arena,
            slots,
            mask if mask is not None else q,
            o,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_arena.stride(0),
            k_arena.stride(1),
            k_arena.stride(2),
            v_arena.stride(0),
            v_arena.stride(1),
            v_arena.stride(2),
            mask.stride(0) if mask is not None else 0,
            mask.stride(2) if mask is not None else 0,
            o.stride(0),
            r,
            gr,
            lmax,
            g,
            D=d,
            BLOCK_M=bm,
            BLOCK_N=bn,
            HAS_MASK=mask is not None,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 products
            INTERPRET_STEPS=triton.cdiv(lmax, bn) if interpreted(_attend_kernel) else 0,
            **pdl_kwargs(q, _attend_kernel),
            num_warps=warps,
            num_stages=stages,
        )
    return o


# the masked calls' kernels (flash takes no mask), in SDPA's fallback order after the preferred one
_SDPA_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SDPA_BACKENDS = ("auto", *_SDPA_KERNELS)


def attend_reference(
    q,
    k_arena,
    v_arena,
    slots,
    lmax: int,
    mask=None,
    groups: int = 1,
    first: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Twin: SDPA (scale 1) on the slots' arena entries, then the transposing copy. `first`: the slots
    are first, first + 1, ... (a host int), read as a slice instead of gathered. `backend`: SDPA's own
    choice ("auto") or one of `SDPA_BACKENDS` tried first for masked calls (cuDNN builds a plan per
    new shape)."""
    nb, kvh, gr, d = q.shape
    r = gr // groups
    pick = slots if first is None else slice(first, first + nb)
    k = k_arena[pick, :, :lmax]
    v = v_arena[pick, :, :lmax]
    if backend != "auto" and mask is not None:
        # preferred, not forced: a GPU or build without that kernel falls back to SDPA's others
        preferred = _SDPA_KERNELS[backend]
        with sdpa_kernel(
            [preferred] + [b for b in _SDPA_KERNELS.values() if b != preferred], set_priority=True
        ):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return o.view(nb, kvh, groups, r, d).permute(0, 3, 1, 2, 4).reshape(nb * r, kvh * groups * d)


def attend(
    q,
    k_arena,
    v_arena,
    slots,
    lmax: int,
    mask=None,
    groups: int = 1,
    impl: str = "auto",
    first: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """q [B, kv, g*R, d] (g = `groups` query heads per KV head), a layer's arena K/V [S, kv, C, d], the B
    windows' slots, their first `lmax` entries, an additive mask [B, 1, g*R, lmax] or None ->
    o [B*R, kv*g*d] (see the module docstring). `first`: see `attend_reference` (the kernel reads any
    slots in place)."""
    if impl == "auto":
        impl = "triton" if auto_triton(q, _attend_kernel) else "torch"
    d = q.shape[-1]
    if impl == "triton" and d >= 16 and triton.next_power_of_2(d) == d:
        return attend_launch(q, k_arena, v_arena, slots, lmax, mask, groups)
    if impl in ("triton", "torch"):
        return attend_reference(q, k_arena, v_arena, slots, lmax, mask, groups, first, backend)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """The kernel at the runtime's tiles for both head dims: sliding 256, full 512
    (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    k = _attend_kernel
    for d in (256, 512):
        bm, bn, warps, stages = _tiles(d)
        consts = {
            "D": d,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "HAS_MASK": True,
            "INTERPRET_STEPS": 0,
            "DOT_PREC": "tf32",
        }
        yield CompileSpec(
            f"attend_d{d} m{bm} n{bn} w{warps} s{stages}",
            k,
            consts,
            types={"slot_ptr": "*i64"},
            divisible=frozenset(n for n in k.arg_names if n.endswith("_ptr") or n.startswith("s")),
            num_warps=warps,
            num_stages=stages,
        )
