"""Structured output's pinning rules for a constrained row group in one launch
(`decoders.constraint_rules.step_rules`): the open rule, the settle rules and the best paths' bookkeeping
that `open_rule` and `settle_rule` do in torch.

In torch the rules are some 80 small selects over [rows, C] and [rows] a step. On the testbed a
GPU's decoder step is bound by the host's launches, not by the GPU's work (a free 64-slot step is
about 900 launches and 11 ms on an H100), so those selects cost a constrained step a fixed share of
its time whatever the rows. Here one program per row reads the row's slot state, its best valid path
and end state (and, with the open rule, the model's argmax), writes the new state and the row's
[C] pins. Rows of one step are on distinct slots, so no two programs touch the same state.

Same arithmetic as the torch rules (integer compares and selects only), so the two give the same
pins and state; `tests/kernels/test_rules.py` runs both over several steps of random paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rules_kernel(
    b_ptr, slot_ptr, start_ptr, think_ptr, at_start_ptr, steps_ptr, fresh_ptr,  # [R] int32: the step's rows (`StepRows`)
    toks_ptr, ends_ptr, argmax_ptr, opens_ptr,  # [R, C] best paths, [R] end states, [R, C] argmax, [V] bool
    path_ptr, has_path_ptr, held_ptr, frozen_ptr, frozen_path_ptr, frozen_end_ptr,  # `SlotRules` [S, ...]
    out_ptr, opening_ptr, opened_ptr,  # out [S, W]: each slot's best path, its end state, the counters
    pins_ptr, ended_ptr,  # [R, C] out: the token pinned at each position, -1: none; [B] bool: pinned whole
    C: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, FRESH: tl.constexpr,  # FRESH: read fresh_ptr (else: slots reset)
    ENDED: tl.constexpr,  # write ended_ptr at the row's b
    OPEN: tl.constexpr, HOLD: tl.constexpr,  # the open rule, and its steps to hold
    SETTLE_RULES: tl.constexpr, SETTLE: tl.constexpr, POSITIONS: tl.constexpr, MAX_STEPS: tl.constexpr,  # -1: off
):  # fmt: skip
    r = tl.program_id(0)
    col = tl.arange(0, BLOCK_C)
    cm = col < C
    sl = tl.load(slot_ptr + r)
    start = tl.load(start_ptr + r)
    think = tl.load(think_ptr + r) != 0
    at_start = tl.load(at_start_ptr + r) != 0
    toks = tl.load(toks_ptr + r * C + col, mask=cm, other=0)
    ends = tl.load(ends_ptr + r)
    if FRESH:  # a new canvas: its slot's state is read as a fresh canvas's
        fresh = tl.load(fresh_ptr + r) != 0
    else:
        fresh = tl.full((), 0, tl.int1)
    srow = sl * C + col
    best_ptr = out_ptr + sl * W  # the slot's row of `out`: C best tokens, the end state, the counters
    tl.store(best_ptr + col, toks, mask=cm)
    tl.store(best_ptr + C, ends)
    pins = tl.full([BLOCK_C], -1, tl.int64)
    if OPEN:
        amax = tl.load(argmax_ptr + r * C + col, mask=cm, other=0)
        hit = (tl.load(opens_ptr + amax, mask=cm, other=0) != 0) & cm
        c = tl.min(tl.where(hit, col, C), axis=0)
        found = c < C
        at_c = tl.minimum(c, C - 1)
        tok = tl.sum(tl.where(col == at_c, amax, 0), axis=0)
        p0 = tl.where(fresh, -1, tl.load(opening_ptr + sl * 3))
        p1 = tl.where(fresh, -1, tl.load(opening_ptr + sl * 3 + 1))
        p2 = tl.where(fresh, -1, tl.load(opening_ptr + sl * 3 + 2))
        o0 = tl.where(fresh, -1, tl.load(opened_ptr + sl * 2))
        o1 = tl.where(fresh, -1, tl.load(opened_ptr + sl * 2 + 1))
        eligible = think & at_start & (o0 < 0) & (ends == start)
        same = (p0 == c) & (p1 == tok) & found
        held_o = tl.where(same, p2 + 1, 0)
        tl.store(opening_ptr + sl * 3, tl.where(eligible, tl.where(found, c.to(tl.int64), -1), p0))
        tl.store(opening_ptr + sl * 3 + 1, tl.where(eligible, tl.where(found, tok, -1), p1))
        tl.store(opening_ptr + sl * 3 + 2, tl.where(eligible, tl.where(found, held_o, -1), p2))
        now = eligible & found & (held_o >= HOLD)
        tl.store(opened_ptr + sl * 2, tl.where(now, c.to(tl.int64), o0))
        tl.store(opened_ptr + sl * 2 + 1, tl.where(now, tok, o1))
        pins = tl.where((col == at_c) & now, tok, pins)
    if SETTLE_RULES:
        frozen = (tl.load(frozen_ptr + sl) != 0) & ~fresh
        has_path = (tl.load(has_path_ptr + sl) != 0) & ~fresh
        thought = think & (ends == start)
        live = ~frozen & ~thought
        old_path = tl.load(path_ptr + srow, mask=cm, other=0)
        old_held = tl.where(fresh, 0, tl.load(held_ptr + srow, mask=cm, other=0))
        held = tl.where((toks == old_path) & has_path, old_held + 1, 0)
        tl.store(held_ptr + srow, tl.where(live, held, tl.where(thought & ~frozen, 0, old_held)), mask=cm)
        tl.store(path_ptr + srow, tl.where(live, toks, old_path), mask=cm)
        tl.store(has_path_ptr + sl, tl.where(frozen, has_path, live))
        cap = live & (tl.load(steps_ptr + r) >= MAX_STEPS) if MAX_STEPS >= 0 else live & ~live
        low = tl.min(tl.where(cm, held, 1 << 30), axis=0)
        settled = live & ~cap & (low >= SETTLE) if SETTLE >= 0 else live & ~live
        tl.store(frozen_ptr + sl, frozen | cap)
        fpath = tl.load(frozen_path_ptr + srow, mask=cm, other=0)
        fend = tl.load(frozen_end_ptr + sl)
        tl.store(frozen_path_ptr + srow, tl.where(cap, toks, fpath), mask=cm)
        tl.store(frozen_end_ptr + sl, tl.where(cap, ends, fend))
        path = tl.where(frozen, fpath, toks)  # a canvas frozen before this step keeps its frozen path
        tl.store(best_ptr + col, path, mask=cm)
        tl.store(best_ptr + C, tl.where(frozen, fend, ends))
        whole = frozen | cap | settled
        settle_pins = tl.where(whole, path, -1)
        n_prefix = 0
        if POSITIONS >= 0:
            opened = (tl.load(opens_ptr + toks, mask=cm, other=0) != 0) & cm
            first = tl.where(at_start, tl.min(tl.where(opened, col, C), axis=0), 0)
            bad = (held < POSITIONS) & (col >= first) & cm
            first_bad = tl.min(tl.where(bad, col, C), axis=0)
            prefix = (col >= first) & (col < first_bad) & cm & live & ~cap & ~settled
            settle_pins = tl.where(prefix, toks, settle_pins)
            n_prefix = tl.sum(prefix.to(tl.int64), axis=0)
        n_settled, n_capped = settled.to(tl.int64), cap.to(tl.int64)
        pins = tl.where(settle_pins >= 0, settle_pins, pins)
    else:
        n_settled = 0
        n_capped = 0
        n_prefix = 0
    counts = best_ptr + C + 1  # written whatever the rules: a fresh canvas's start from 0
    tl.store(counts, tl.where(fresh, 0, tl.load(counts)) + n_settled)
    tl.store(counts + 1, tl.where(fresh, 0, tl.load(counts + 1)) + n_capped)
    tl.store(counts + 2, tl.where(fresh, 0, tl.load(counts + 2)) + n_prefix)
    tl.store(pins_ptr + r * C + col, pins, mask=cm)
    if ENDED:  # every position pinned (`constraint_rules.pinned_whole`)
        whole = tl.min(tl.where(cm, pins, 0), axis=0) >= 0
        tl.store(ended_ptr + tl.load(b_ptr + r), whole)


def rules(st, rows, toks: torch.Tensor, ends: torch.Tensor, argmax: torch.Tensor | None, opens: torch.Tensor,
          hold: int | None, settle: int | None, positions: int | None, max_steps: int | None,
          ended: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One launch of the rules over `rows` (`constraint_rules.StepRows`) with slot state `st`
    (`SlotRules`): the state updated in place, -> [R, C] pins. `argmax` [R, C] is read when `hold`
    is set (the open rule); the settle rules run when `settle` or `max_steps` is set. `ended` [B] bool,
    if given, is set at `rows.b` for the rows pinned at every position."""
    R, C = toks.shape
    pins = torch.empty(R, C, dtype=torch.long, device=toks.device)
    if R == 0:
        return pins
    off = -1
    _rules_kernel[(R,)](
        rows.b, rows.slot, rows.start, rows.think, rows.at_start, rows.steps,
        rows.slot if rows.fresh is None else rows.fresh,
        toks.contiguous(), ends, toks if argmax is None else argmax.contiguous(), opens,
        st.path, st.has_path, st.held, st.frozen, st.frozen_path, st.frozen_end,
        st.out, st.opening, st.opened,
        pins, pins if ended is None else ended,
        C=C, W=st.out.shape[1], BLOCK_C=triton.next_power_of_2(C), FRESH=rows.fresh is not None, ENDED=ended is not None,
        OPEN=hold is not None, HOLD=off if hold is None else hold,
        SETTLE_RULES=settle is not None or max_steps is not None, SETTLE=off if settle is None else settle,
        POSITIONS=off if positions is None else positions, MAX_STEPS=off if max_steps is None else max_steps,
    )  # fmt: skip
    return pins


def compile_specs():
    """The rules at the real canvas, every rule on (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    cols = (
        "b_ptr",
        "slot_ptr",
        "start_ptr",
        "think_ptr",
        "at_start_ptr",
        "steps_ptr",
        "fresh_ptr",
    )  # `StepRows`
    i64 = {n: "*i64" for n in ("toks_ptr", "ends_ptr", "argmax_ptr")}
    state = ("path_ptr", "frozen_path_ptr", "frozen_end_ptr", "out_ptr", "opening_ptr")
    i64 |= {n: "*i64" for n in (*state, "opened_ptr", "pins_ptr")}
    i1 = {n: "*i1" for n in ("opens_ptr", "has_path_ptr", "frozen_ptr", "ended_ptr")}
    yield CompileSpec(
        "rules",
        _rules_kernel,
        {"C": 256, "W": 260, "BLOCK_C": 256, "FRESH": True, "ENDED": True, "OPEN": True, "HOLD": 1, "SETTLE_RULES": True, "SETTLE": 1,
         "POSITIONS": 1, "MAX_STEPS": -1},
        types=i64 | i1 | {n: "*i32" for n in (*cols, "held_ptr")},
    )  # fmt: skip
