"""Fused residual-stream norms of a DiffusionGemma layer: fewer, larger launches around the matmuls.

- `add_rms_norm(x, weight, residual, x2=None, scale=None, pre=None)`: (residual + rms(x + x2) * weight)
  * scale, the residual updates after attention and at the end of a layer (x2: the experts' output
  added to the dense MLP's, or their uncombined `ExpertRows`, combined in the same launch; scale: the
  layer scalar, read from device memory so CUDA graphs replay it; pre: the two branches' own
  post-norm weights, applied first in the same launch).
- `pre_ffn_norms(x, wa, post, scalar, wb)`: the three norms of the residual stream that feed the
  dense MLP, the router (times its scale and H^-0.5) and the experts, from one read of x.

All compute in fp32 but round to the model dtype at every point where HF's modules round (after
the norm, after each RoPE product and sum, after the residual add and the layer scalar), so in bf16
they reproduce HF's values, not a more precise variant of them: a trained model's logits move by
~8 % of their range when these roundings are skipped (measured in fp16 on the testbed).
`_math.rt` is that rounding (a no-op in fp32). The torch twins follow HF op for op.

As the head norms (`norm_rope.py`), the kernels compile with floating-point contraction off
(`NO_FP_FUSION`) so no rounded product and sum become one FMA; their compile specs say
`rounds_like_hf`, checked by `tests/kernels/test_norm_fused.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, pdl_kwargs
from ._math import NO_FP_FUSION, pdl_enter, rt
from .fp8_quant import quant_outputs, quant_tile_store
from .moe.kernels import combine_row
from .moe.launch import ExpertRows
from .rmsnorm import rms_norm_reference


@triton.jit
def _normed(x, w_ptr, cols, D, eps, DT: tl.constexpr):
    """rms(x) * w over the rows of an fp32 [BLOCK_R, BLOCK_D] tile, rounded to DT (HF's RMSNorm)."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return rt(x * inv[:, None] * w[None, :], DT)


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
    # every load first (x, the residual, the experts' rows): one round trip to memory, not one per phase
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32)
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
            x2 = rt(c, DT)[None, :]
        else:
            x2 = tl.load(x2_ptr + off, mask=m, other=0.0).to(tl.float32)
    if PRE_NORM:
        x = _normed(x, wx_ptr, cols, D, eps, DT)
    if HAS_X2:
        if PRE_NORM:
            x2 = _normed(x2, wx2_ptr, cols, D, eps, DT)
        x = rt(x + x2, DT)
    normed = _normed(x, w_ptr, cols, D, eps, DT)
    y = rt(res + normed, DT)
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
    qa_ptr,
    sa_ptr,
    R,
    D,
    eps,
    scalar,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT_A: tl.constexpr,
    PDL: tl.constexpr,
):
    """One read of x [R, D], three norms out: ya = rms(x) * wa, yb = rms(x) * wb and the router's
    input yr = round(round(rms(x)) * post) * scalar, each rounded to the output dtype where HF rounds.
    QUANT_A: ya goes out quantised per row for the FP8 dense MLP (e4m3 qa, fp32 scale sa; `fp8_quant`),
    not written itself."""
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
    if QUANT_A:
        quant_tile_store((n * wa[None, :]).to(DT).to(tl.float32), qa_ptr, sa_ptr, rows, cols, m, R, D)
    else:
        tl.store(ya_ptr + off, (n * wa[None, :]).to(DT), mask=m)
    wb = tl.load(wb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(yb_ptr + off, (n * wb[None, :]).to(DT), mask=m)
    post = tl.load(post_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    r = rt(rt(n, DT) * post[None, :], DT) * scalar
    tl.store(yr_ptr + off, r.to(DT), mask=m)


# --- launchers ---------------------------------------------------------------------------------------
# The end of layer's combine at 96 registers a thread: three programs of 8 warps an SM instead of two (at
# 102), for 83.4 against 110.8 us at 4,096 rows on an H200 (80: 87.6, a few bytes spilled) and 23.9 against
# 29.5 at 1,024 (BENCHMARKS "The end of layer's loads, and the norms that feed FP8 GEMMs write e4m3")
COMBINE_MAXNREG = 96


def _check_rows(rows: ExpertRows, r: int, D: int, dtype) -> int:
    """The layouts the kernel's combine assumes of the experts' rows; their top k."""
    top_k = rows.ids.shape[1]
    assert rows.shape == (r, D) and rows.y_tk.stride(-1) == 1 and rows.weights.is_contiguous()
    assert rows.ids.is_contiguous() and rows.y_tk.dtype == dtype
    assert rows.row_map is None or (rows.row_map.is_contiguous() and rows.row_map.numel() == r * top_k)
    return top_k


def add_rms_norm_launch(
    x,
    weight,
    residual,
    x2=None,
    scale=None,
    eps: float = 1e-6,
    pre: tuple | None = None,
    num_warps: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """`add_rms_norm`'s kernel; `num_warps` / `maxnreg` (registers a thread) override its launch."""
    D = x.shape[-1]
    assert pre is None or x2 is not None, "pre-norm weights come in a pair (x's and x2's)"
    rows = x2 if isinstance(x2, ExpertRows) else None
    dense = () if x2 is None or rows is not None else (x2,)
    xs = [t.reshape(-1, D).contiguous() for t in (x, residual) + dense]
    r = xs[0].shape[0]
    y = torch.empty_like(xs[1])
    block_d = triton.next_power_of_2(D)
    block_r = 1 if rows is not None else max(1, min(16, 4096 // block_d, triton.next_power_of_2(max(r, 1))))
    # 8 warps from a 4,096-wide row (the real 2,816): on an H100 the end of layer's call 136.6 against 143.5
    # us at 4,096 rows, the attention's 23.8 against 24.3 (`probes/norm_fusion_gpu_timing.py --warps`)
    warps = num_warps or (8 if block_d >= 4096 else 4)  # block_r keeps block_d * block_r <= 4,096 below it
    top_k = _check_rows(rows, r, D, y.dtype) if rows is not None else 1
    cap = maxnreg or (COMBINE_MAXNREG if rows is not None else None)
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
            TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k),
            RENORM=rows is not None and rows.expert_scale is not None,
            ROW_MAP=rows is not None and rows.row_map is not None,
            **pdl_kwargs(y, _add_rms_norm_kernel),
            num_warps=warps,
            **({"maxnreg": cap} if cap else {}),
            **NO_FP_FUSION,
        )
    return y.view(residual.shape)


def pre_ffn_norms_launch(x, wa, post, scalar: float, wb, eps: float = 1e-6, quant_a: bool = False):
    """The kernel; `quant_a`: the first output is (q [R, D] e4m3, scale [R]) of rms(x) * wa."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    r = x2.shape[0]
    outs = tuple(x2 if quant_a and i == 0 else torch.empty_like(x2) for i in range(3))
    qa = quant_outputs(r, D, x.device) if quant_a else (x2, x2)
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 4096 // block_d, triton.next_power_of_2(max(r, 1))))
    if r:
        _pre_ffn_norms_kernel[(triton.cdiv(r, block_r),)](
            x2,
            wa,
            post,
            wb,
            *outs,
            *qa,
            r,
            D,
            float(eps),
            float(scalar),
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            QUANT_A=quant_a,
            **pdl_kwargs(x2, _pre_ffn_norms_kernel),
            num_warps=4 if block_d * block_r <= 4096 else 8,
            **NO_FP_FUSION,
        )
    return (qa if quant_a else outs[0].view(x.shape), outs[1].view(x.shape), outs[2].view(x.shape))


# --- torch twins (HF's op order) ----------------------------------------------------------------------
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


def pre_ffn_norms(
    x, wa, post, scalar: float, wb, eps: float = 1e-6, impl: str = "auto", quant_a: bool = False
):
    """x [..., D] -> (rms(x) * wa, rms(x) * post * scalar, rms(x) * wb), HF's roundings, one launch:
    the three norms a DiffusionGemma layer takes of its residual stream before the dense MLP,
    the router and the experts. `quant_a` (the kernel only): the first comes quantised per row for the
    FP8 dense MLP, (q e4m3, scale fp32), as `fp8_quant.quantize_rows_triton` would make it."""
    if impl == "auto":
        impl = "triton" if auto_triton(x, _pre_ffn_norms_kernel) else "torch"
    if impl == "triton":
        return pre_ffn_norms_launch(x, wa, post, scalar, wb, eps, quant_a)
    if quant_a:
        raise ValueError("quant_a=True needs impl='triton': the torch twin writes no quantised rows")
    if impl == "torch":
        return pre_ffn_norms_reference(x, wa, post, scalar, wb, eps)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """The residual-update and pre-FFN norms as the runtime launches them, with / without the experts'
    combine (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    hf = {"options": NO_FP_FUSION, "rounds_like_hf": True}
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
        opts = {**hf, "options": {**NO_FP_FUSION, "maxnreg": COMBINE_MAXNREG}} if combine else hf
        yield CompileSpec(name, _add_rms_norm_kernel, c, add_types, add, num_warps=8, **opts)
    pre = frozenset({"x_ptr", "ya_ptr", "yr_ptr", "yb_ptr", "qa_ptr", "D"})
    types = {"eps": "fp32", "scalar": "fp32", "qa_ptr": "*fp8e4nv", "sa_ptr": "*fp32"}
    for quant in (False, True):  # quantised: the FP8 dense MLP's input
        c = {"BLOCK_R": 1, "BLOCK_D": 4096, "QUANT_A": quant}
        name = "pre_ffn_norms" + ("_quant" if quant else "")
        yield CompileSpec(name, _pre_ffn_norms_kernel, c, types, pre, num_warps=8, **hf)
