"""The sampler's draw by inverse CDF over the sums the statistics pass already keeps (`draw="invcdf"`).

The Gumbel-max draw (`softmax_argmax`) costs a uniform and two logarithms per logit, most of the
statistics pass's arithmetic at the real vocabulary. This draw needs one uniform per row instead: the
statistics pass keeps, per (row, slice), its maximum and sum of exp(l − m) (the stage-1 partials) and,
per lane of the slice, the same pair (`LANE_MAX`, `LANE_SUM`); then one small program per row

1. takes U in [0, 1) from the row's Philox stream (seed of its group, counter = its index in the group:
   the Gumbel draws' counters, unused on this path; the renoise token keeps its own),
2. picks the slice where the running sum of w_c = s_c · exp(m_c − M) first passes U · Σ w_c,
3. inside it, the lane the same way (a lane holds columns j, j + BLOCK_V, j + 2·BLOCK_V, … of the slice),
4. and inside the lane the column, reading only that lane's CHUNK / BLOCK_V logits again.

The categories are visited in a fixed order (slice, lane, column) and each is weighted by exp(l − M),
so the draw follows softmax(l · inv_temp) exactly up to fp32 rounding; a rounding overshoot falls on
the last category with weight (never on a masked, −inf logit). Draws are per row and batch-invariant
(a row's depend on its seed and its index in its group only), but they are other draws than Gumbel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softcap import cap_args, softcap_on_read


@triton.jit
def _pick(w, below, N: tl.constexpr):
    """Index of the first running sum of `w` [N] past `below`, clamped to the last positive weight,
    and the sum before it."""
    at = tl.arange(0, N)
    run = tl.cumsum(w, 0)
    i = tl.sum((run <= below).to(tl.int32), axis=0)
    i = tl.minimum(i, tl.max(tl.where(w > 0, at, 0), axis=0))
    return i, tl.sum(tl.where(at < i, w, 0.0), axis=0)


@triton.jit
def _invcdf_draw_kernel(
    logits_ptr,
    pm_ptr,
    ps_ptr,
    lane_max_ptr,
    lane_sum_ptr,
    inv_temp_ptr,
    seed_ptr,
    draw_ptr,
    V,
    stride_r,
    GROUP,
    inv_cap,
    cap,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PER_LANE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = row // GROUP
    u = tl.rand(tl.load(seed_ptr + group), (row % GROUP).to(tl.int32))
    cs = tl.arange(0, CHUNKS)
    pm = tl.load(pm_ptr + row * CHUNKS + cs)
    top = tl.max(pm, axis=0)
    w = tl.where(pm > -1e29, tl.load(ps_ptr + row * CHUNKS + cs) * tl.exp(pm - top), 0.0)
    target = u * tl.sum(w, axis=0)
    c, before = _pick(w, target, CHUNKS)
    rest = target - before
    lanes = tl.arange(0, BLOCK_V)
    at = (row * CHUNKS + c) * BLOCK_V + lanes
    lm = tl.load(lane_max_ptr + at)
    wl = tl.where(lm > -1e29, tl.load(lane_sum_ptr + at) * tl.exp(lm - top), 0.0)
    j, before = _pick(wl, rest, BLOCK_V)
    rest = rest - before
    ks = tl.arange(0, PER_LANE)
    cols = c * CHUNK + j + ks * BLOCK_V
    ok = (ks * BLOCK_V < CHUNK) & (cols < V)
    l = tl.load(logits_ptr + row * stride_r + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTCAP:
        l = softcap_on_read(l, inv_cap, cap, INTERPRETED)
    l = l * tl.load(inv_temp_ptr + group)
    e = tl.where(l > float("-inf"), tl.exp(l - top), 0.0)
    k, _ = _pick(e, rest, PER_LANE)
    tl.store(draw_ptr + row, (c * CHUNK + j + k * BLOCK_V).to(tl.int64))


DRAWS = ("gumbel", "invcdf")  # the draw's rule: Gumbel-max in the statistics pass, or this module's


def invcdf_rule(draw: str) -> bool:
    """Whether `draw` asks for this module's draw; an unknown rule is refused."""
    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    return draw == "invcdf"


def lane_sums(R: int, chunks: int, block_v: int, dev) -> torch.Tensor:
    """The buffer the statistics pass writes each lane's sum of exp(l − lane max) into."""
    return torch.empty(R, chunks * block_v, dtype=torch.float32, device=dev)


def draw_invcdf(
    logits, pm, ps, lane_max, lane_sum, inv_temp, seeds, draw, group, chunks, chunk, block_v, cap
):
    """Overwrites `draw` [R] with one inverse-CDF draw per row (module docstring), from the stage-1
    partials `pm`, `ps` [R, chunks] and lane states [R, chunks · block_v] of the same launch."""
    from ._dispatch import interpreted

    R, V = logits.shape
    _invcdf_draw_kernel[(R,)](
        logits,
        pm,
        ps,
        lane_max,
        lane_sum,
        inv_temp,
        seeds,
        draw,
        V,
        logits.stride(0),
        group,
        *cap_args(cap),
        CHUNKS=chunks,
        CHUNK=chunk,
        BLOCK_V=block_v,
        PER_LANE=triton.next_power_of_2(triton.cdiv(chunk, block_v)),
        SOFTCAP=bool(cap),
        INTERPRETED=interpreted(_invcdf_draw_kernel),
        num_warps=4,
    )


def compile_specs():
    """The draw at the real vocabulary over bf16 logits, with the soft cap on read and without
    (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    for softcap in (False, True):
        yield CompileSpec(
            "softmax_invcdf_draw" + ("_softcap" if softcap else ""),
            _invcdf_draw_kernel,
            {
                "CHUNKS": 2,
                "CHUNK": 131072,
                "BLOCK_V": 2048,
                "PER_LANE": 64,
                "SOFTCAP": softcap,
                "INTERPRETED": False,
            },
            types={
                "pm_ptr": "*fp32",
                "ps_ptr": "*fp32",
                "lane_max_ptr": "*fp32",
                "lane_sum_ptr": "*fp32",
                "inv_temp_ptr": "*fp32",
                "seed_ptr": "*i64",
                "draw_ptr": "*i64",
                "inv_cap": "fp32",
                "cap": "fp32",
            },
            divisible=frozenset({"logits_ptr", "V", "stride_r"}),
            num_warps=4,
        )
