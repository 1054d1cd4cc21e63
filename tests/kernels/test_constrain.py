"""Structured output's masking in one launch (`kernels.constrain`) against the torch steps it replaces:
the plans' masked fill, the opening's pin (`pin_torch`), `logsumexp` and `argmax`."""

import pytest
import torch
from kernel_testutil import DEVICE

from canvasq.decoders.constraint_rules import NEG, pin_torch
from canvasq.kernels.constrain import constrain


def _case(V: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    B, C, P, S = 6, 5, 3, 8
    logits = torch.randn(B, C, V, generator=gen)
    plans = torch.rand(P, C, V, generator=gen) < 0.6  # True: banned
    plans[1, 2] = True  # a position whose plan bans everything: all NEG, argmax 0
    rows = torch.tensor([4, 0, 2, 5])  # rows of the group out of order; rows 1 and 3 free
    plan = torch.tensor([1, 0, 2, 1])
    slots = torch.tensor([7, 1, 3, 0])
    opened = torch.full((S, 2), -1, dtype=torch.long)
    opened[7] = torch.tensor([3, V - 1])  # row 4 opened at position 3 with the last token
    opened[3] = torch.tensor([0, 2])  # row 2 at position 0
    opened[1] = torch.tensor([-1, 9])  # not opened: no pin
    return logits, rows, plan, plans, slots, opened


def _torch(logits, rows, plan, plans, slots, opened):
    out = logits.clone()
    out[rows] = out[rows].masked_fill_(plans[plan], NEG)
    pins = torch.full((len(rows), out.shape[1]), -1, dtype=torch.long)
    at, tok = opened[slots, 0], opened[slots, 1]
    has = at >= 0
    pins[has.nonzero()[:, 0], at[has]] = tok[has]
    pin_torch(out, rows, pins)
    return out, torch.logsumexp(out[rows], dim=-1), out[rows].argmax(dim=-1)


@pytest.mark.parametrize("V", [37, 1500])  # under one block, and several blocks with a ragged end
@pytest.mark.parametrize("open_hold", [True, False])
def test_masking_matches_the_torch_steps(V, open_hold):
    logits, rows, plan, plans, slots, opened = _case(V)
    if not open_hold:
        opened = torch.full_like(opened, -1)
    want, want_lse, want_arg = _torch(logits, rows, plan, plans, slots, opened)
    got = logits.to(DEVICE)
    dev = [t.to(DEVICE) for t in (rows, plan, plans, slots, opened)]
    lse, argmax = constrain(got, *dev[:3], *((dev[3], dev[4]) if open_hold else (None, None)), neg=NEG)
    assert torch.equal(got.cpu(), want)  # rows 1 and 3 untouched, the rest masked and pinned
    assert torch.equal(argmax.cpu(), want_arg)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-4)
    if open_hold:  # the pins took: row 4 (r 0) at position 3, row 2 (r 2) at position 0
        assert argmax[0, 3] == V - 1 and argmax[2, 0] == 2 and abs(float(lse[0, 3])) < 1e-4


def test_a_new_canvas_pins_no_opening_of_its_slots_last_canvas():
    """`fresh` rows (canvases begun since their slot's last masked step) are masked as if their slot's
    `opened` were reset: row 4's opening from slot 7's earlier canvas is not pinned."""
    logits, rows, plan, plans, slots, opened = _case(1500)
    reset = opened.clone()
    reset[7] = -1
    want, want_lse, want_arg = _torch(logits, rows, plan, plans, slots, reset)
    got = logits.to(DEVICE)
    i32 = [t.to(DEVICE, torch.int32) for t in (rows, plan, slots)]
    fresh = torch.tensor([1, 0, 0, 0], dtype=torch.int32, device=DEVICE)
    lse, argmax = constrain(got, i32[0], i32[1], plans.to(DEVICE), i32[2], opened.to(DEVICE), NEG, fresh)
    assert torch.equal(got.cpu(), want) and torch.equal(argmax.cpu(), want_arg)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-4)
    assert argmax[2, 0] == 2  # a row that is not fresh keeps its opening


def test_ties_take_the_first_maximum_across_blocks():
    """The argmax the rules read is torch's: the first of equal maxima, here one in each of two blocks."""
    V = 2500
    logits = torch.full((1, 2, V), -3.0)
    logits[0, 0, 1500] = logits[0, 0, 2400] = 4.0
    logits[0, 1, 7] = logits[0, 1, 1100] = 4.0
    plans = torch.zeros(1, 2, V, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.long, device=DEVICE)
    _, argmax = constrain(logits.to(DEVICE), zero, zero, plans.to(DEVICE), neg=NEG)
    assert argmax.cpu().tolist() == [[1500, 7]]


def test_no_rows_is_nothing():
    logits = torch.randn(2, 4, 9, device=DEVICE)
    before = logits.clone()
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    lse, argmax = constrain(logits, empty, empty, torch.zeros(1, 4, 9, dtype=torch.bool, device=DEVICE))
    assert torch.equal(logits, before) and lse.shape == argmax.shape == (0, 4)


def test_a_stream_masked_in_one_launch_decodes_what_the_torch_masks_decode():
    """The decoder's own use of it (`CanvasConstraints.mask` with `kernels` on: the plans from its
    `PlanTable`, the opening pinned from the rules' slot state, the argmax the open rule reads): the
    same rows through a stream of three slots, thinking and not, two schemas and a free row, give the
    same texts and the same rule counters as the torch masks."""
    from canvasq.decoders import make_decoder
    from canvasq.decoders.slots import drain
    from canvasq.decoders.types import DecodeRequest
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks
    from canvasq.testbed.json_adapter import apply_adapter
    from tests.decoders.test_structured import ANSWER, SIGN

    testbed = load_bundle(device=DEVICE)
    apply_adapter(testbed, "models/adapters/testbed_json_composite")  # its rows open documents, as served
    C = testbed.canvas_length
    problems = tasks.generate("arith", 6, 5, split="dev")
    shapes = [(ANSWER, True), (SIGN, False), (None, False), (ANSWER, False), (SIGN, True), (ANSWER, True)]
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), 5 * C, "arith", schema, think)
        for p, (schema, think) in zip(problems, shapes)
    ]
    got = {}
    for kernels in (False, True):
        dec = make_decoder("official", testbed, {"cuda_graphs": "off"})
        dec.constraints.kernels = kernels
        got[kernels] = drain(dec, reqs, 3, 2)
        assert bool(dec.constraints.table.index) == kernels  # the table held the plans only when fused
    keys = ("constrained_canvases", "constraint_pinned_steps", "constraint_pinned_positions")
    for a, b in zip(got[False], got[True]):
        assert (a.text, a.reasoning, a.error) == (b.text, b.reasoning, b.error)
        assert [a.stats.get(k) for k in keys] == [b.stats.get(k) for k in keys]
    assert sum(r.stats.get("constrained_canvases", 0) for r in got[True]) >= 5


def test_the_open_rule_pins_the_brace_through_the_kernel():
    """The open rule's scenario (tests/decoders/test_structured.py) with the masks, the opening's pin
    and the argmax the rule reads made by `kernels.constrain`."""
    from canvasq.model.loading import load_bundle
    from tests.decoders.test_structured import TOKENIZER, open_hold_scenario, token_texts

    open_hold_scenario(token_texts(TOKENIZER), load_bundle(), kernels=True, device=DEVICE)


def test_the_plan_table_starts_over_when_full_and_refuses_a_step_it_cannot_hold():
    from canvasq.decoders.constrained import PlanTable, RowGrammar

    C, V = 3, 4
    plans = [torch.rand(C, V, generator=torch.Generator().manual_seed(k)) < 0.5 for k in range(5)]
    rows = [RowGrammar(None, 0, plans[k], plan=("g", k, 9)) for k in range(5)]  # type: ignore[arg-type]
    table = PlanTable(C, V, torch.device(DEVICE), max_bytes=3 * C * V)  # room for three plans
    assert table.ids([rows[0], rows[1], rows[0]]) == [0, 1, 0]
    assert table.ids([rows[2], rows[1]]) == [2, 1]  # the third fits beside them
    assert table.ids([rows[3], rows[4]]) == [0, 1]  # no room: the table starts over with this step's
    for row, i in zip([rows[3], rows[4]], [0, 1]):
        assert torch.equal(table.plans[i].cpu(), row.banned)
    assert table.ids(rows[:4]) is None  # four plans in one step: more than the table holds
