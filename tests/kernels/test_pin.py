"""Structured output's pins in one launch (`kernels.pin`) against the torch select the CPU runs
(`decoders.constraint_rules.pin_torch`)."""

import pytest
import torch
from kernel_testutil import DEVICE

from canvasq.decoders.constraint_rules import NEG, pin_torch
from canvasq.kernels.pin import pin_positions


@pytest.mark.parametrize("V", [37, 1500])  # under one block, and several blocks with a ragged end
def test_pins_match_the_torch_select(V):
    """fp32, as the constraint's logits are (the sampler's input, capped)."""
    gen = torch.Generator().manual_seed(3)
    B, C = 5, 6
    logits = torch.randn(B, C, V, generator=gen).to(DEVICE)
    rows = torch.tensor([3, 0, 4], device=DEVICE)  # rows of the group, out of order; rows 1 and 2 free
    pins = torch.full((3, C), -1, dtype=torch.long)
    pins[0, 0], pins[0, C - 1], pins[1, 2], pins[2, 4] = 0, V - 1, V // 2, 7
    pins = pins.to(DEVICE)
    want, got = logits.clone(), logits.clone()
    pin_torch(want, rows, pins)
    pin_positions(got, rows, pins, NEG)
    assert torch.equal(got, want)
    changed = (got != logits).any(dim=-1)  # only the pinned positions moved
    assert changed.nonzero().tolist() == [[0, 2], [3, 0], [3, C - 1], [4, 4]]
    assert got[3, 0, 0] == 0 and (got[3, 0, 1:] == got[3, 0, 1]).all() and got[3, 0, 1] < -1e4
    assert got[0, 2].argmax() == V // 2 and got[4, 4].argmax() == 7


def test_no_rows_is_nothing():
    logits = torch.randn(2, 4, 9, device=DEVICE)
    before = logits.clone()
    pin_positions(
        logits, torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, 4, dtype=torch.long), NEG
    )
    assert torch.equal(logits, before)
