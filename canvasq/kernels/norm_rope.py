"""Fused q/k/v head norms of a DiffusionGemma attention layer: fewer, larger launches around the
matmuls.

- `rms_norm_rope(x, weight, cos, sin)`: per-head RMSNorm then rotate-half RoPE, for q and k
  (`weight=None, cos=None`: the V norm). x [N, h, d] may be a strided view (a column slice of the
  fused QKV output); the result is contiguous [N, h, d], or written through a `Scatter` into the
  arena / the folded queries. HF runs this as ~6 launches per tensor.
- `qkv_norm_rope(q, k, v, ...)`: the three of a layer in one launch.

All compute in fp32 but round to the model dtype at every point where HF's modules round (after
the norm, after each RoPE product and sum, after the residual add and the layer scalar), so in bf16
they reproduce HF's values, not a more precise variant of them: a trained model's logits move by
~8 % of their range when these roundings are skipped (measured in fp16 on the testbed).
`_math.rt` is that rounding (a no-op in fp32). The torch twins follow HF op for op.

The kernels compile with floating-point contraction off (`NO_FP_FUSION`): with it on, LLVM fuses
`rt(x * cos) + rt(rot * sin)` into `fma.rn.bf16`, one rounding where HF has two, which moved the
trained testbed's bf16 logits by 6 %. Their compile specs say `rounds_like_hf`: compiled for sm_90,
a half-precision FMA in their PTX fails `tests/kernels/test_norm_fused.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, pdl_kwargs
from ._math import NO_FP_FUSION, pdl_enter, rt
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
    x1 = rt(x1, DT)  # HF: the norm's output is cast to the model dtype
    x2 = rt(x2, DT)
    if HAS_ROPE:  # y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each op rounded
        cb = cos_ptr + row[:, None] * stride_cn + cols[None, :]
        sb = sin_ptr + row[:, None] * stride_cn + cols[None, :]
        c1 = tl.load(cb, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cb + HALF, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sb, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sb + HALF, mask=m, other=0.0).to(tl.float32)
        x1, x2 = (
            rt(rt(x1 * c1, DT) + rt(-x2 * s1, DT), DT),
            rt(rt(x2 * c2, DT) + rt(x1 * s2, DT), DT),
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


def compile_specs():
    """The q/k/v norms as the runtime launches them, at both head dims (sliding layers 256, full 512)
    (benchmarks/kernels/compile_check.py)."""
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
