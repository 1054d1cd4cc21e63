"""Structured output's per-step masking in one launch (`decoders.constrained.CanvasConstraints.mask`):
each constrained (row, position)'s logits banned outside its plan, the opening the rules pinned
(`constraint_open_hold`) applied, and the result's log-sum-exp and argmax written for the Viterbi and
the rules.

In torch that is a stack of the rows' [C, V] plans, a gather, a masked fill and a scatter back, five
launches for the opening's pin, a gather and a composite `logsumexp` for the Viterbi, and an argmax: a
couple of dozen launches a step, each several microseconds of host time, on a step that a GPU runs
host-bound at the testbed's size (the phase clock: the mask hook 2.1 ms of a 12 ms step on an
H100). Here one program per (row, position) reads its V logits once, in blocks, with an online
log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _constrain_kernel(
    logits_ptr, stride_b, stride_c,  # [B, C, V] fp32 logits, written in place (last dim contiguous)
    rows_ptr, plan_ptr, slot_ptr, fresh_ptr,  # [R] int32: logits row, plan in `plans`, slot, new canvas
    plans_ptr,  # [P, C, V] uint8: 1 where the plan bans the token
    opened_ptr,  # [S, 2] int64 (position, token) pinned at each slot's canvas (-1: none)
    lse_ptr, argmax_ptr,  # [R, C] fp32, int64 outputs
    neg,
    V: tl.constexpr, C: tl.constexpr, BLOCK_V: tl.constexpr, OPEN: tl.constexpr, FRESH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = pid // C
    c = pid % C
    row = tl.load(rows_ptr + r).to(tl.int64)
    plan = tl.load(plan_ptr + r).to(tl.int64)
    tok = -1
    if OPEN:
        slot = tl.load(slot_ptr + r)
        at = tl.load(opened_ptr + slot * 2)
        if FRESH:  # a canvas that began since its slot's last masked step has opened nothing yet
            at = tl.where(tl.load(fresh_ptr + r) != 0, -1, at)
        tok = tl.where(at == c, tl.load(opened_ptr + slot * 2 + 1), -1)
    base = logits_ptr + row * stride_b + c * stride_c
    pbase = plans_ptr + (plan * C + c) * V
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.zeros((), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        ok = v < V
        x = tl.load(base + v, mask=ok, other=0.0).to(tl.float32)
        banned = tl.load(pbase + v, mask=ok, other=1) != 0
        x = tl.where(banned, neg, x)
        x = tl.where(tok >= 0, tl.where(v == tok, 0.0, neg), x)  # the pinned opening: one-hot
        tl.store(base + v, x.to(logits_ptr.dtype.element_ty), mask=ok)
        x = tl.where(ok, x, float("-inf"))
        top = tl.max(x, axis=0)
        at_top = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32) + v0
        new = tl.maximum(m, top)
        s = s * tl.exp(m - new) + tl.sum(tl.exp(x - new), axis=0)
        best = tl.where(top > m, at_top, best)  # ties keep the earlier block: torch's first maximum
        m = new
    tl.store(lse_ptr + pid, m + tl.log(s))
    tl.store(argmax_ptr + pid, best.to(tl.int64))


def constrain(
    logits: torch.Tensor,
    rows: torch.Tensor,
    plan: torch.Tensor,
    plans: torch.Tensor,
    slots: torch.Tensor | None = None,
    opened: torch.Tensor | None = None,
    neg: float = -1.0e9,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, C, V] (last dim contiguous), in place: row rows[r]'s logits banned (`neg`) where
    plans[plan[r]] ([P, C, V] bool) is True; with `opened` ([S, 2]: position, token per slot; `slots`
    [R]) the position a slot opened its document at made one-hot on that token (0, `neg` elsewhere),
    but not for rows whose `fresh` [R] is nonzero (a new canvas: its slot's `opened` is stale).
    Returns the R rows' log-sum-exp [R, C] fp32 and argmax [R, C] int64 after both."""
    R, C = len(rows), logits.shape[1]
    lse = torch.empty(R, C, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(R, C, dtype=torch.int64, device=logits.device)
    if R == 0:
        return lse, argmax
    assert logits.stride(2) == 1 and plans.shape[1:] == logits.shape[1:] and plans.is_contiguous()
    OPEN = opened is not None
    _constrain_kernel[(R * C,)](
        logits, logits.stride(0), logits.stride(1),
        rows, plan, slots if OPEN else rows, rows if fresh is None else fresh, plans.view(torch.uint8),
        opened if OPEN else rows, lse, argmax, neg,
        V=logits.shape[2], C=C, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(logits.shape[2])), OPEN=OPEN,
        FRESH=fresh is not None,
    )  # fmt: skip
    return lse, argmax


def compile_specs():
    """The masking at the real canvas and vocabulary (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "constrain",
        _constrain_kernel,
        {"V": 262144, "C": 256, "BLOCK_V": BLOCK_V, "OPEN": True, "FRESH": True},
        types={
            "logits_ptr": "*fp32",
            "rows_ptr": "*i32",
            "plan_ptr": "*i32",
            "slot_ptr": "*i32",
            "fresh_ptr": "*i32",
            "plans_ptr": "*u8",
            "opened_ptr": "*i64",
            "lse_ptr": "*fp32",
            "argmax_ptr": "*i64",
            "neg": "fp32",
        },
    )
