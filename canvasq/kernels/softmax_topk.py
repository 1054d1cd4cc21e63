"""The k largest scaled logits per row (`softmax_sample`'s `top_k`, self-conditioning's input) from
stage 1's lane maxima (`softmax_argmax`, `LANE_MAX`): a threshold, one gather of the logits at or
above it into TOP_K_CAP candidate slots per row, torch.topk over those slots only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpreted
from .softcap import cap_args, softcap_on_read, softcap_reference


@triton.jit
def _gather_above_kernel(
    logits_ptr,
    inv_temp_ptr,
    thresh_ptr,
    count_ptr,
    vals_ptr,
    ids_ptr,
    V,
    stride_r,
    GROUP,
    inv_cap,
    cap,
    CAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCKS: tl.constexpr,  # cdiv(V, BLOCK_V): a constant trip count (the interpreter cannot loop to V)
    SOFTCAP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # one program per row, in vocabulary order (deterministic): every scaled logit >= the row's
    # threshold goes to the row's first CAP candidate slots; the count is stored even past CAP
    row = tl.program_id(0).to(tl.int64)
    inv_temp = tl.load(inv_temp_ptr + row // GROUP)
    t = tl.load(thresh_ptr + row)
    lanes = tl.arange(0, BLOCK_V)
    n = 0
    for blk in range(BLOCKS):
        cols = blk * BLOCK_V + lanes
        l = tl.load(logits_ptr + row * stride_r + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            l = softcap_on_read(l, inv_cap, cap, INTERPRETED)
        l = l * inv_temp
        keep = (l >= t) & (cols < V)
        found = tl.sum(keep.to(tl.int32), axis=0)
        if found > 0:  # most blocks hold no candidate: they cost only their read (no scan, no stores)
            pos = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            ok = keep & (pos < CAP)
            tl.store(vals_ptr + row * CAP + pos, l, mask=ok)
            tl.store(ids_ptr + row * CAP + pos, cols.to(tl.int64), mask=ok)
        n += found
    tl.store(count_ptr + row, n)


TOP_K_CAP = 512  # candidate slots per row; a row with more candidates falls back to torch.topk
# Scaled logits at or below this are masked (structured output sets them to `constraint_rules.NEG`,
# -1e9, which stays below it at any temperature up to 10): never candidates. A row with fewer than k
# unmasked logits (a constrained position: digits, a brace) then fills the rest of its k with -inf and
# id 0, which weigh nothing in the self-conditioning softmax, as masked logits would. Without the floor
# such a row's masked logits tie at the threshold, fill the slots and send the row to the fallback (at
# the real vocabulary a [rows, 262,144] copy and sort per step).
MASKED_FLOOR = -1.0e8
# The gather's block and warps. Each pass of its loop ends in a reduction over the block (does it hold
# a candidate?), so with wide blocks the loop waits on those reductions, not on memory: on an H200,
# 64 x 256 rows at the real vocabulary took 13.6 ms at 2,048 columns and 8 warps, 5.8 ms at 512 and
# one warp (near the bandwidth of one full read; BENCHMARKS.md "Service throughput")
GATHER_BLOCK, GATHER_WARPS = 512, 1


def top_k_scaled(
    logits,
    inv_temp,
    group: int,
    k: int,
    lane_max: torch.Tensor,
    block_v: int = GATHER_BLOCK,
    cap: float | None = None,
    num_warps: int = GATHER_WARPS,
):
    """The k largest scaled logits per row without sorting the vocabulary. Each lane's maximum is a
    logit of its own, so the k-th largest lane maximum t has at least k logits >= t above it: the
    row's top k are among the logits >= t, which one more read gathers (few, past the peak). `cap`:
    the logits are the LM head's output before its final soft cap, applied as they are read. Masked
    logits (`MASKED_FLOOR`) are never among the k: a row with fewer unmasked ones gets -inf (id 0) in
    the rest."""
    R, V = logits.shape
    if lane_max.shape[1] < k:  # fewer lanes than k: every unmasked logit is a candidate
        thresh = torch.full((R,), MASKED_FLOOR, device=logits.device)
    else:
        thresh = torch.topk(lane_max, k, dim=-1).values[:, -1].clamp_min(MASKED_FLOOR).contiguous()
    slots = max(TOP_K_CAP, triton.next_power_of_2(k))
    vals = torch.full((R, slots), float("-inf"), device=logits.device)
    ids = torch.zeros(R, slots, dtype=torch.long, device=logits.device)
    count = torch.empty(R, dtype=torch.int32, device=logits.device)
    if R:
        bv = min(block_v, triton.next_power_of_2(V))
        _gather_above_kernel[(R,)](
            logits,
            inv_temp,
            thresh,
            count,
            vals,
            ids,
            V,
            logits.stride(0),
            group,
            *cap_args(cap),
            CAP=slots,
            BLOCK_V=bv,
            BLOCKS=triton.cdiv(V, bv),
            SOFTCAP=bool(cap),
            INTERPRETED=interpreted(_gather_above_kernel),
            num_warps=num_warps,
        )
    top, pos = torch.topk(vals, k, dim=-1)
    top_ids = torch.gather(ids, 1, pos)
    over = (count > slots).nonzero().flatten()  # a host sync; empty unless logits tie at the top
    if over.numel():
        scale = inv_temp.repeat_interleave(group)[over, None]
        rows = softcap_reference(logits[over], cap) if cap else logits[over].float()
        v2, i2 = torch.topk(rows * scale, k, dim=-1)
        top[over], top_ids[over] = v2, i2
    return top, top_ids


def compile_specs():
    """The gather over bf16 logits at the real vocabulary, capped as read and not
    (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    for softcap in (False, True):
        yield CompileSpec(
            "softmax_gather_above" + ("_softcap" if softcap else ""),
            _gather_above_kernel,
            {
                "CAP": TOP_K_CAP,
                "BLOCK_V": GATHER_BLOCK,
                "BLOCKS": 262144 // GATHER_BLOCK,
                "SOFTCAP": softcap,
                "INTERPRETED": False,
            },
            types={
                "inv_cap": "fp32",
                "cap": "fp32",
                "inv_temp_ptr": "*fp32",
                "thresh_ptr": "*fp32",
                "count_ptr": "*i32",
                "vals_ptr": "*fp32",
                "ids_ptr": "*i64",
            },
            divisible=frozenset({"logits_ptr", "V", "stride_r"}),
            num_warps=GATHER_WARPS,
        )
