"""Fused norm epilogues of a DiffusionGemma layer: fewer, larger launches around the matmuls.

- `rms_norm_rope(x, weight, cos, sin)`: per-head RMSNorm then rotate-half RoPE, for q and k
  (`weight=None, cos=None`: the V norm). x [N, h, d] may be a strided view (a column slice of the
  fused QKV output); the result is contiguous [N, h, d]. HF runs this as ~6 launches per tensor.
- `add_rms_norm(x, weight, residual, x2=None, scale=None, pre=None)`: (residual + rms(x + x2) * weight)
  * scale, the residual updates after attention and at the end of a layer (x2: the experts' output
  added to the dense MLP's; scale: the layer scalar, read from device memory so CUDA graphs replay
  it; pre: the two branches' own post-norm weights, applied first in the same launch).
- `pre_ffn_norms(x, wa, post, scalar, wb)`: the three norms of the residual stream that feed the
  dense MLP, the router (times its scale and H^-0.5) and the experts, from one read of x.

All compute in fp32 but round to the model dtype at every point where HF's modules round (after
the norm, after each RoPE product and sum, after the residual add and the layer scalar), so in bf16
they reproduce HF's values, not a more precise variant of them: a trained model's logits move by
~8 % of their range when these roundings are skipped (measured in fp16 on the testbed). `_rt` is
that rounding (a no-op in fp32). The torch twins follow HF op for op.

The kernels compile with floating-point contraction off (`NO_FP_FUSION`): with it on, LLVM fuses
`_rt(x * cos) + _rt(rot * sin)` into `fma.rn.bf16`, one rounding where HF has two, which moved the
trained testbed's bf16 logits by 6 %. Their compile specs say `rounds_like_hf`: compiled for sm_90,
a half-precision FMA in their PTX fails `tests/kernels/test_norm_fused.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, pdl_kwargs
from ._math import NO_FP_FUSION, pdl_enter
from .moe.kernels import combine_row
from .moe.launch import ExpertRows
from .rmsnorm import rms_norm_reference


@dataclass(frozen=True)
class Scatter:
    """Where `rms_norm_rope` writes row n, head h: `dst[a[n], h, b[n], :]` of a 4-D `dst` whose
    last dim is contiguous. The runtime points it at a layer's arena K/V ([slots, kv, capacity, d],
    a = slot, b = entry) and at the attention's folded queries ([B, heads, Rmax, d], a = window,
    b = row), so neither needs a separate copy or index_put."""

    dst: torch.Tensor
    a: torch.Tensor  # [N] int
    b: torch.Tensor  # [N] int

    def check(self, n: int, heads: int, d: int, dtype: torch.dtype) -> None:
        if self.dst.dim() != 4 or self.dst.shape[1] != heads or self.dst.shape[3] != d:
            raise ValueError(f"scatter target {tuple(self.dst.shape)} does not take [{n}, {heads}, {d}] rows")
        if (
            self.dst.stride(-1) != 1
            or self.dst.dtype != dtype
            or self.a.shape != (n,)
            or self.b.shape != (n,)
        ):
            raise ValueError("scatter target needs a contiguous last dim, the rows' dtype and [N] indices")


@triton.jit
def _rt(v, DT: tl.constexpr):
    """Round an fp32 value to the model dtype and back (what HF's dtype-level op would store)."""
    return v.to(DT).to(tl.float32)


@triton.jit
def _norm_rope_rows(
    pid,
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    a_ptr,
    b_ptr,
    R,
    HEADS,
    stride_xn,
    stride_xh,
    stride_cn,
    stride_ya,
    stride_yh,
    stride_yb,
    eps,
    HALF: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Block `pid`: BLOCK_R (row, head) vectors of width 2 * HALF, read as their two halves.
    Row n, head h goes to y + n*stride_ya + h*stride_yh, or with SCATTER to
    y + a[n]*stride_ya + h*stride_yh + b[n]*stride_yb (an arena slot/entry, a folded query layout)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    idx = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    live = idx < R
    row = (idx // HEADS).to(tl.int64)
    head = (idx % HEADS).to(tl.int64)
    cols = tl.arange(0, HALF)
    m = live[:, None]
    base = x_ptr + row[:, None] * stride_xn + head[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    x1 = x1 * inv[:, None]
    x2 = x2 * inv[:, None]
    if HAS_WEIGHT:
        x1 = x1 * tl.load(w_ptr + cols).to(tl.float32)[None, :]
        x2 = x2 * tl.load(w_ptr + HALF + cols).to(tl.float32)[None, :]
    x1 = _rt(x1, DT)  # HF: the norm's output is cast to the model dtype
    x2 = _rt(x2, DT)
    if HAS_ROPE:  # y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each op rounded
        cb = cos_ptr + row[:, None] * stride_cn + cols[None, :]
        sb = sin_ptr + row[:, None] * stride_cn + cols[None, :]
        c1 = tl.load(cb, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cb + HALF, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sb, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sb + HALF, mask=m, other=0.0).to(tl.float32)
        x1, x2 = (
            _rt(_rt(x1 * c1, DT) + _rt(-x2 * s1, DT), DT),
            _rt(_rt(x2 * c2, DT) + _rt(x1 * s2, DT), DT),
        )
    if SCATTER:
        ra = tl.load(a_ptr + row, mask=live, other=0).to(tl.int64)
        rb = tl.load(b_ptr + row, mask=live, other=0).to(tl.int64)
        dst = ra * stride_ya + head * stride_yh + rb * stride_yb
    else:
        dst = row * stride_ya + head * stride_yh
    out = y_ptr + dst[:, None] + cols[None, :]
    tl.store(out, x1.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(out + HALF, x2.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    a_ptr,
    b_ptr,
    R,
    HEADS,
    stride_xn,
    stride_xh,
    stride_cn,
    stride_ya,
    stride_yh,
    stride_yb,
    eps,
    HALF: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: `_norm_rope_rows` block program_id(0)."""
    pdl_enter(PDL)
    _norm_rope_rows(
        tl.program_id(0), x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, a_ptr, b_ptr, R, HEADS, stride_xn,
        stride_xh, stride_cn, stride_ya, stride_yh, stride_yb, eps, HALF, HAS_WEIGHT, HAS_ROPE, SCATTER,
        BLOCK_R,
    )  # fmt: skip


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr, qw_ptr, qy_ptr, qa_ptr, qb_ptr, RQ, HQ, sq_xn, sq_xh, sq_ya, sq_yh, sq_yb,
    k_ptr, kw_ptr, ky_ptr, ka_ptr, kb_ptr, RK, HK, sk_xn, sk_xh, sk_ya, sk_yh, sk_yb,
    v_ptr, vy_ptr, va_ptr, vb_ptr, sv_xn, sv_xh, sv_ya, sv_yh, sv_yb,
    cos_ptr, sin_ptr, stride_cn, eps,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A layer's three head norms in one launch, each block as `_norm_rope_rows`: the first
    cdiv(RQ, BLOCK_R) programs q (weight, RoPE), then k (weight, RoPE; RK vectors), then v (the
    unweighted V norm over k's rows and heads), all scattered."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    nq = tl.cdiv(RQ, BLOCK_R)
    nk = tl.cdiv(RK, BLOCK_R)
    if pid < nq:
        _norm_rope_rows(
            pid, q_ptr, qw_ptr, cos_ptr, sin_ptr, qy_ptr, qa_ptr, qb_ptr, RQ, HQ, sq_xn, sq_xh, stride_cn,
            sq_ya, sq_yh, sq_yb, eps, HALF, True, True, True, BLOCK_R,
        )  # fmt: skip
    elif pid < nq + nk:
        _norm_rope_rows(
            pid - nq, k_ptr, kw_ptr, cos_ptr, sin_ptr, ky_ptr, ka_ptr, kb_ptr, RK, HK, sk_xn, sk_xh,
            stride_cn, sk_ya, sk_yh, sk_yb, eps, HALF, True, True, True, BLOCK_R,
        )  # fmt: skip
    else:
        _norm_rope_rows(
            pid - nq - nk, v_ptr, v_ptr, cos_ptr, sin_ptr, vy_ptr, va_ptr, vb_ptr, RK, HK, sv_xn, sv_xh,
            stride_cn, sv_ya, sv_yh, sv_yb, eps, HALF, False, False, True, BLOCK_R,
        )  # fmt: skip


@triton.jit
def _normed(x, w_ptr, cols, D, eps, DT: tl.constexpr):
    """rms(x) * w over the rows of an fp32 [BLOCK_R, BLOCK_D] tile, rounded to DT (HF's RMSNorm)."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return _rt(x * inv[:, None] * w[None, :], DT)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    x2_ptr,
    w_ptr,
    wx_ptr,
    wx2_ptr,
    res_ptr,
    scale_ptr,
    y_ptr,
    rw_ptr,
    ids_ptr,
    es_ptr,
    map_ptr,
    R,
    D,
    stride_ym,
    eps,
    HAS_X2: tl.constexpr,
    PRE_NORM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMBINE: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    RENORM: tl.constexpr,
    ROW_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """y = (res + rms(x [+ x2]) * w) [* scale]; all tensors contiguous [R, D]. PRE_NORM: x and x2
    are first normalised themselves, with weights wx and wx2 (the dense MLP's and the experts'
    post-norms at the end of a layer). COMBINE (BLOCK_R 1): x2 is the experts' combine of row t,
    from x2_ptr = their uncombined rows [R*TOP_K, D] (row stride stride_ym), weights rw, ids and
    expert scales es (`moe.kernels.combine_row`), rounded to the dtype as the combine kernel stores it."""
    pdl_enter(PDL)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = (rows[:, None] < R) & (cols[None, :] < D)
    off = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    if PRE_NORM:
        x = _normed(x, wx_ptr, cols, D, eps, DT)
    if HAS_X2:
        if COMBINE:
            t = tl.program_id(0).to(tl.int64)
            c = combine_row(
                x2_ptr,
                rw_ptr,
                ids_ptr,
                es_ptr,
                map_ptr,
                t,
                cols,
                cols < D,
                stride_ym,
                TOP_K,
                K_P2,
                RENORM,
                ROW_MAP,
            )
            x2 = _rt(c, DT)[None, :]
        else:
            x2 = tl.load(x2_ptr + off, mask=m, other=0.0).to(tl.float32)
        if PRE_NORM:
            x2 = _normed(x2, wx2_ptr, cols, D, eps, DT)
        x = _rt(x + x2, DT)
    normed = _normed(x, w_ptr, cols, D, eps, DT)
    y = _rt(tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32) + normed, DT)
    if HAS_SCALE:
        y = y * tl.load(scale_ptr).to(tl.float32)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _pre_ffn_norms_kernel(
    x_ptr,
    wa_ptr,
    post_ptr,
    wb_ptr,
    ya_ptr,
    yr_ptr,
    yb_ptr,
    R,
    D,
    eps,
    scalar,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One read of x [R, D], three norms out: ya = rms(x) * wa, yb = rms(x) * wb and the router's
    input yr = round(round(rms(x)) * post) * scalar, each rounded to the output dtype where HF rounds."""
    pdl_enter(PDL)
    DT: tl.constexpr = ya_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    m = (rows[:, None] < R) & cm[None, :]
    off = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    n = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps))[:, None]
    wa = tl.load(wa_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(ya_ptr + off, (n * wa[None, :]).to(DT), mask=m)
    wb = tl.load(wb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(yb_ptr + off, (n * wb[None, :]).to(DT), mask=m)
    post = tl.load(post_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    r = _rt(_rt(n, DT) * post[None, :], DT) * scalar
    tl.store(yr_ptr + off, r.to(DT), mask=m)


# --- launchers ---------------------------------------------------------------------------------------
def rms_norm_rope_launch(x, weight, cos, sin, eps: float, out: Scatter | None = None) -> torch.Tensor:
    n, heads, d = x.shape
    assert x.stride(-1) == 1 and d % 2 == 0 and triton.next_power_of_2(d) == d, x.shape
    if out is None:
        y = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
        a = b = None
        strides = (heads * d, d, 0)
    else:
        out.check(n, heads, d, x.dtype)
        y, a, b = out.dst, out.a, out.b
        strides = (y.stride(0), y.stride(1), y.stride(2))
    rope = cos is not None
    if rope:
        assert cos.shape == sin.shape == (n, d) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    r = n * heads
    block_r = _block_r(d)
    if r:
        _rms_norm_rope_kernel[(triton.cdiv(r, block_r),)](
            x,
            weight if weight is not None else x,
            cos if rope else x,
            sin if rope else x,
            y,
            a if out is not None else y,
            b if out is not None else y,
            r,
            heads,
            x.stride(0),
            x.stride(1),
            cos.stride(0) if rope else 0,
            *strides,
            float(eps),
            HALF=d // 2,
            HAS_WEIGHT=weight is not None,
            HAS_ROPE=rope,
            SCATTER=out is not None,
            BLOCK_R=block_r,
            **pdl_kwargs(x, _rms_norm_rope_kernel),
            num_warps=4,
            **NO_FP_FUSION,
        )
    return y


def _block_r(d: int) -> int:
    return max(1, min(16, 4096 // d))


def qkv_norm_rope_launch(q, k, v, q_weight, k_weight, cos, sin, eps: float, q_out, k_out, v_out) -> None:
    """`rms_norm_rope` of q (q_weight, RoPE) into q_out, k (k_weight, RoPE) into k_out and the V norm of
    v into v_out (all `Scatter`s) in one launch; q may be None (an encoder's K/V-only last layer)."""
    n, hk, d = k.shape
    assert v.shape == k.shape and d % 2 == 0 and triton.next_power_of_2(d) == d, (k.shape, v.shape)
    assert cos.shape == sin.shape == (n, d) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    for x, out in ((q, q_out), (k, k_out), (v, v_out)):
        if x is not None:
            assert x.stride(-1) == 1 and x.shape[0] == n and x.shape[-1] == d, x.shape
            out.check(n, x.shape[1], d, x.dtype)
    block_r = _block_r(d)
    rq = 0 if q is None else n * q.shape[1]
    rk = n * hk
    grid = triton.cdiv(rq, block_r) + 2 * triton.cdiv(rk, block_r)
    qs = (q, q_weight, q_out) if q is not None else (k, k_weight, k_out)  # unread when rq == 0
    if rk:
        _qkv_norm_rope_kernel[(grid,)](
            qs[0], qs[1], qs[2].dst, qs[2].a, qs[2].b, rq, qs[0].shape[1], qs[0].stride(0), qs[0].stride(1),
            *qs[2].dst.stride()[:3],
            k, k_weight, k_out.dst, k_out.a, k_out.b, rk, hk, k.stride(0), k.stride(1), *k_out.dst.stride()[:3],
            v, v_out.dst, v_out.a, v_out.b, v.stride(0), v.stride(1), *v_out.dst.stride()[:3],
            cos, sin, cos.stride(0), float(eps),
            HALF=d // 2,
            BLOCK_R=block_r,
            **pdl_kwargs(k, _qkv_norm_rope_kernel),
            num_warps=4,
            **NO_FP_FUSION,
        )  # fmt: skip


def add_rms_norm_launch(
    x, weight, residual, x2=None, scale=None, eps: float = 1e-6, pre: tuple | None = None
) -> torch.Tensor:
    D = x.shape[-1]
    assert pre is None or x2 is not None, "pre-norm weights come in a pair (x's and x2's)"
    rows = x2 if isinstance(x2, ExpertRows) else None
    dense = () if x2 is None or rows is not None else (x2,)
    xs = [t.reshape(-1, D).contiguous() for t in (x, residual) + dense]
    r = xs[0].shape[0]
    y = torch.empty_like(xs[1])
    block_d = triton.next_power_of_2(D)
    block_r = 1 if rows is not None else max(1, min(16, 4096 // block_d, triton.next_power_of_2(max(r, 1))))
    if rows is not None:
        top_k = rows.ids.shape[1]
        assert rows.shape == (r, D) and rows.y_tk.stride(-1) == 1 and rows.weights.is_contiguous()
        assert rows.ids.is_contiguous() and rows.y_tk.dtype == y.dtype
        assert rows.row_map is None or (rows.row_map.is_contiguous() and rows.row_map.numel() == r * top_k)
    if r:
        _add_rms_norm_kernel[(triton.cdiv(r, block_r),)](
            xs[0],
            rows.y_tk if rows is not None else (xs[2] if x2 is not None else xs[0]),
            weight,
            pre[0] if pre is not None else weight,
            pre[1] if pre is not None else weight,
            xs[1],
            scale if scale is not None else weight,
            y,
            rows.weights if rows is not None else weight,
            rows.ids if rows is not None else weight,
            rows.expert_scale if rows is not None and rows.expert_scale is not None else weight,
            rows.row_map if rows is not None and rows.row_map is not None else weight,
            r,
            D,
            rows.y_tk.stride(0) if rows is not None else 0,
            float(eps),
            HAS_X2=x2 is not None,
            PRE_NORM=pre is not None,
            HAS_SCALE=scale is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            COMBINE=rows is not None,
            TOP_K=top_k if rows is not None else 1,
            K_P2=triton.next_power_of_2(top_k) if rows is not None else 1,
            RENORM=rows is not None and rows.expert_scale is not None,
            ROW_MAP=rows is not None and rows.row_map is not None,
            **pdl_kwargs(y, _add_rms_norm_kernel),
            num_warps=4 if block_d * block_r <= 4096 else 8,
            **NO_FP_FUSION,
        )
    return y.view(residual.shape)


def pre_ffn_norms_launch(x, wa, post, scalar: float, wb, eps: float = 1e-6):
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    r = x2.shape[0]
    outs = tuple(torch.empty_like(x2) for _ in range(3))
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 4096 // block_d, triton.next_power_of_2(max(r, 1))))
    if r:
        _pre_ffn_norms_kernel[(triton.cdiv(r, block_r),)](
            x2,
            wa,
            post,
            wb,
            *outs,
            r,
            D,
            float(eps),
            float(scalar),
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            **pdl_kwargs(x2, _pre_ffn_norms_kernel),
            num_warps=4 if block_d * block_r <= 4096 else 8,
            **NO_FP_FUSION,
        )
    return tuple(t.view(x.shape) for t in outs)


# --- torch twins (HF's op order) ----------------------------------------------------------------------
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, h, d], cos/sin [N, d]: x * cos + rotate_half(x) * sin in x's dtype (HF's RoPE)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def rms_norm_rope_reference(
    x, weight, cos, sin, eps: float = 1e-6, out: Scatter | None = None
) -> torch.Tensor:
    """HF: q/k norm (fp32, cast), then x * cos + rotate_half(x) * sin in the model dtype."""
    y = rms_norm_reference(x, weight, eps)
    y = y.contiguous() if cos is None else rope_reference(y, cos, sin)
    if out is None:
        return y
    n, heads, d = y.shape
    out.check(n, heads, d, y.dtype)
    out.dst[out.a, :, out.b] = y
    return out.dst


def add_rms_norm_reference(
    x, weight, residual, x2=None, scale=None, eps: float = 1e-6, pre: tuple | None = None
) -> torch.Tensor:
    """HF: residual + norm(x + x2) in the model dtype, then times the layer scalar; with `pre`
    (wx, wx2), x and x2 are first norm(x) * wx and norm(x2) * wx2. x2 may be `ExpertRows` (combined
    first)."""
    if isinstance(x2, ExpertRows):
        x2 = x2.combined()
    if pre is not None:
        x, x2 = rms_norm_reference(x, pre[0], eps), rms_norm_reference(x2, pre[1], eps)
    y = residual + rms_norm_reference(x + x2 if x2 is not None else x, weight, eps)
    return y * scale if scale is not None else y


def pre_ffn_norms_reference(x, wa, post, scalar: float, wb, eps: float = 1e-6):
    """HF: the dense MLP's pre-norm, the router's input norm(x) * scale * scalar, the experts' pre-norm."""
    router = rms_norm_reference(x, None, eps) * post * scalar
    return rms_norm_reference(x, wa, eps), router, rms_norm_reference(x, wb, eps)


# --- public ---------------------------------------------------------------------------------------------
def rms_norm_rope(
    x, weight, cos=None, sin=None, eps: float = 1e-6, impl: str = "auto", out: Scatter | None = None
) -> torch.Tensor:
    """x [N, h, d] (last dim contiguous), weight [d] or None, cos/sin [N, d] or None -> [N, h, d],
    or, with `out`, written into `out.dst` at (out.a[n], h, out.b[n]) and `out.dst` returned."""
    if impl == "auto":
        impl = "triton" if auto_triton(x, _rms_norm_rope_kernel) else "torch"
    d = x.shape[-1]
    if impl == "triton" and d % 2 == 0 and triton.next_power_of_2(d) == d:
        return rms_norm_rope_launch(x, weight, cos, sin, eps, out)
    if impl in ("triton", "torch"):  # the kernel reads power-of-two halves: other head dims use the twin
        return rms_norm_rope_reference(x, weight, cos, sin, eps, out)
    raise ValueError(f"unknown impl {impl!r}")


def qkv_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps: float, q_out, k_out, v_out, impl: str = "auto"):
    """The three head norms of an attention layer into their `Scatter` targets: q and k normalised with
    their weights and rotated, v normalised without weight (`rms_norm_rope` each); one launch on the
    kernel path (power-of-two head dims), three twin calls otherwise. q may be None (K/V only)."""
    if impl == "auto":
        impl = "triton" if auto_triton(k, _qkv_norm_rope_kernel) else "torch"
    d = k.shape[-1]
    if impl == "triton" and d % 2 == 0 and triton.next_power_of_2(d) == d:
        return qkv_norm_rope_launch(q, k, v, q_weight, k_weight, cos, sin, eps, q_out, k_out, v_out)
    if impl not in ("triton", "torch"):
        raise ValueError(f"unknown impl {impl!r}")
    rms_norm_rope_reference(k, k_weight, cos, sin, eps, k_out)
    rms_norm_rope_reference(v, None, None, None, eps, v_out)
    if q is not None:
        rms_norm_rope_reference(q, q_weight, cos, sin, eps, q_out)


def add_rms_norm(
    x, weight, residual, x2=None, scale=None, eps: float = 1e-6, impl: str = "auto", pre: tuple | None = None
):
    """(residual + rms(x + x2) * weight) * scale; x, x2, residual [..., D]; scale a [1] tensor or None;
    `pre` = (wx, wx2): normalise x and x2 first (the end of a layer: one launch for three norms).
    x2 may be the experts' uncombined `ExpertRows` (x and residual then [T, D]): their combine happens
    in the same launch."""
    if impl == "auto":
        impl = "triton" if auto_triton(x, _add_rms_norm_kernel) else "torch"
    if impl == "triton":
        return add_rms_norm_launch(x, weight, residual, x2, scale, eps, pre)
    if impl == "torch":
        return add_rms_norm_reference(x, weight, residual, x2, scale, eps, pre)
    raise ValueError(f"unknown impl {impl!r}")


def pre_ffn_norms(x, wa, post, scalar: float, wb, eps: float = 1e-6, impl: str = "auto"):
    """x [..., D] -> (rms(x) * wa, rms(x) * post * scalar, rms(x) * wb), HF's roundings, one launch:
    the three norms a DiffusionGemma layer takes of its residual stream before the dense MLP,
    the router and the experts."""
    if impl == "auto":
        impl = "triton" if auto_triton(x, _pre_ffn_norms_kernel) else "torch"
    if impl == "triton":
        return pre_ffn_norms_launch(x, wa, post, scalar, wb, eps)
    if impl == "torch":
        return pre_ffn_norms_reference(x, wa, post, scalar, wb, eps)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """The fused norms as the runtime launches them, at both head dims (sliding layers 256, full 512)
    and with / without the experts' combine (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    hf = {"options": NO_FP_FUSION, "rounds_like_hf": True}
    rope = frozenset({"x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "y_ptr", "stride_xn", "stride_xh", "stride_cn"})
    qkv = _qkv_norm_rope_kernel
    qkv_types = {**{n: "*i64" for n in qkv.arg_names if n[1:] in ("a_ptr", "b_ptr")}, "eps": "fp32"}
    qkv_div = frozenset(n for n in qkv.arg_names if n.endswith("_ptr"))
    for d in (256, 512):
        c = {"HALF": d // 2, "HAS_WEIGHT": True, "HAS_ROPE": True, "SCATTER": True, "BLOCK_R": 4096 // d}
        yield CompileSpec(f"rms_norm_rope_d{d}", _rms_norm_rope_kernel, c, {"eps": "fp32"}, rope, **hf)
        c = {"HALF": d // 2, "BLOCK_R": 4096 // d}
        yield CompileSpec(f"qkv_norm_rope_d{d}", qkv, c, qkv_types, qkv_div, **hf)
    add = frozenset({"x_ptr", "x2_ptr", "w_ptr", "res_ptr", "y_ptr", "D", "stride_ym"})
    add_types = {"rw_ptr": "*fp32", "ids_ptr": "*i64", "map_ptr": "*i64", "eps": "fp32"}
    for combine in (False, True):  # the end of a layer: the experts' output combined, or their rows
        c = {"HAS_X2": True, "PRE_NORM": True, "HAS_SCALE": True, "BLOCK_R": 1, "BLOCK_D": 4096}
        c |= {
            "COMBINE": combine,
            "TOP_K": 8,
            "K_P2": 8,
            "RENORM": True,
            "ROW_MAP": combine,
        }  # FP8 rows: mapped
        name = "add_rms_norm" + ("_combine" if combine else "")
        yield CompileSpec(name, _add_rms_norm_kernel, c, add_types, add, num_warps=8, **hf)
    pre = frozenset({"x_ptr", "ya_ptr", "yr_ptr", "yb_ptr", "D"})
    c, types = {"BLOCK_R": 1, "BLOCK_D": 4096}, {"eps": "fp32", "scalar": "fp32"}
    yield CompileSpec("pre_ffn_norms", _pre_ffn_norms_kernel, c, types, pre, num_warps=8, **hf)
