"""Structured output's rules in one launch (`kernels.rules`) against the torch rules the CPU runs
(`decoders.constraint_rules.step_rules(kernel=False)`): the same pins and the same slot state after
every step of a random walk of paths, for each combination of rules."""

import pytest
import torch
from kernel_testutil import DEVICE

from canvasq.decoders.constraint_rules import FIELDS, OUT_FIELDS, SlotRules, StepRows, step_rules

C, V, S, B = 6, 20, 7, 8  # C not a power of two: the kernel's masked tail; B the group's rows


def _rows(slots, steps):
    R = len(slots)  # rows 0-1 think from the grammar's start, row 2 starts in the document, row 3 has none
    think, at_start = torch.tensor([1, 1, 1, 0]).bool(), torch.tensor([1, 1, 0, 1]).bool()
    return StepRows(
        torch.tensor([6, 1, 3, 0][:R]),  # rows of a group of B: not in order, some left out
        torch.tensor(slots),
        torch.zeros(R, dtype=torch.long),
        think,
        at_start,
        torch.full((R,), steps),
    )


def _to(rows: StepRows, fresh: list[int] | None = None) -> StepRows:
    """`rows` on the kernel's device as the decoder copies them (int32 columns); with `fresh`, the rows
    flagged as new canvases (`StepRows.fresh`) instead of their slots reset."""
    cols = [
        getattr(rows, f).to(DEVICE, torch.int32) for f in ("b", "slot", "start", "think", "at_start", "steps")
    ]
    if fresh is not None:
        return StepRows(*cols, fresh=torch.tensor(fresh, dtype=torch.int32, device=DEVICE))
    return StepRows(*cols)


@pytest.mark.parametrize(
    "hold, settle, positions, max_steps",
    [
        (1, 1, 1, None),
        (None, 2, None, 3),
        (2, None, None, None),
        (None, None, None, None),
        (1, None, 1, 2),
        (1, 3, 2, 4),
    ],
)
@pytest.mark.parametrize("flagged", [False, True])  # new canvases: slots reset, or flagged to the kernel
def test_the_kernel_keeps_the_torch_rules_state_and_pins(hold, settle, positions, max_steps, flagged):
    gen = torch.Generator().manual_seed(11)
    opens = torch.zeros(V, dtype=torch.bool)
    opens[[3, 7]] = True  # two tokens that open a document
    ref, got = SlotRules(C, torch.device("cpu")), SlotRules(C, torch.device(DEVICE))
    ref.grow(S - 1), got.grow(S - 1)
    slots = [5, 0, 3, 2]
    toks = torch.randint(0, V, (len(slots), C), generator=gen)
    seen = set()
    for step in range(1, 11):
        renew = step == 5  # two canvases end: their slots begin again
        if renew:
            ref.reset([0, 3])
            if not flagged:
                got.reset([0, 3])
        keep = torch.rand(toks.shape, generator=gen) < 0.75  # most positions hold from step to step
        toks = torch.where(keep, toks, torch.randint(0, V, toks.shape, generator=gen))
        ends = torch.where(
            torch.rand(len(slots), generator=gen) < 0.4, 0, torch.randint(1, 5, (len(slots),), generator=gen)
        )
        argmax = torch.where(
            torch.rand(toks.shape, generator=gen) < 0.8, toks, torch.randint(0, V, toks.shape, generator=gen)
        )
        ends[:2] = torch.where(
            torch.rand(2, generator=gen) < 0.8, 0, ends[:2]
        )  # their paths still all thought
        ends[2] = 0 if step % 4 == 0 else 1 + step % 3  # held positions, then a step of thought only
        argmax[:2, 2] = torch.where(
            torch.rand(2, generator=gen) < 0.8, 3, argmax[:2, 2]
        )  # an opening that holds
        rows = _rows(slots, step)
        ended_ref, ended = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool, device=DEVICE)
        want = step_rules(
            ref,
            rows,
            toks,
            ends,
            argmax,
            opens,
            hold,
            settle,
            positions,
            max_steps,
            kernel=False,
            ended=ended_ref,
        )
        dev = _to(rows, [int(renew and sl in (0, 3)) for sl in slots] if flagged else None)
        have = step_rules(
            got, dev, toks.to(DEVICE), ends.to(DEVICE), argmax.to(DEVICE), opens.to(DEVICE), hold, settle,
            positions, max_steps, kernel=True, ended=ended,
        )  # fmt: skip
        if want is None:
            assert have is None
        else:
            assert torch.equal(have.cpu(), want), f"step {step}"
            seen |= {"pinned"} if (want >= 0).any() else set()
            seen |= {"whole"} if ended_ref.any() else set()
            assert torch.equal(
                ended_ref, (want >= 0).all(dim=-1).new_zeros(B).index_put((rows.b,), (want >= 0).all(dim=-1))
            )
        assert torch.equal(ended.cpu(), ended_ref), f"ended at step {step}"
        for name in (*FIELDS, *OUT_FIELDS):
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), f"{name} at step {step}"
    if hold is not None or settle is not None:
        assert seen, "the walk never pinned: the comparison proved nothing"
    if settle is not None or max_steps is not None:
        assert "whole" in seen, "no canvas was pinned whole: the ended rows went untested"


@pytest.mark.parametrize("whole", [True, False])
def test_a_read_gives_the_slots_paths_ends_and_counters_with_the_head(whole, monkeypatch):
    """`SlotRules.read_with` reads the table whole when it is small and gathers the slots first when it
    is not: both give each slot's row of `out` (in the order asked) and the head's rows."""
    import canvasq.decoders.constraint_rules as cr

    monkeypatch.setattr(cr, "OUT_READ_BYTES", 1 << 20 if whole else 8)
    st = SlotRules(C, torch.device(DEVICE))
    st.grow(S - 1)
    st.out.copy_(torch.arange(st.out.numel()).reshape(st.out.shape))
    head = torch.arange(2 * C, device=DEVICE).reshape(2, C) + 1000
    first, rows = st.read_with(head, [4, 1])
    assert first == head.tolist()
    W = C + 1 + 3
    for (best, end, counts), sl in zip(rows, [4, 1]):
        assert best == list(range(sl * W, sl * W + C)) and end == sl * W + C
        assert counts == [sl * W + C + 1, sl * W + C + 2, sl * W + C + 3]
    assert st.read([6]) == [(list(range(6 * W, 6 * W + C)), 6 * W + C, [6 * W + C + k for k in (1, 2, 3)])]
