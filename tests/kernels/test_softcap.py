"""Fused fp32 cast + final logit soft cap against the twin (HF's four passes)."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU

from canvasq.kernels.softcap import softcap_launch, softcap_logits, softcap_reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 4099), (3, 2, 300)])
def test_softcap_parity(shape, dtype):
    x = torch.randn(shape, device=DEVICE) * 40
    x.view(-1)[:2] = torch.tensor([300.0, -95.0])  # past the cap (tanh saturates) and near it
    x = x.to(dtype)
    y = softcap_launch(x, 30.0)
    want = softcap_reference(x, 30.0)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # CPU twin divides exactly and uses its own tanh: a few fp32 ulps apart; CUDA: the same ops
    assert (y - want).abs().max().item() <= (0.0 if ON_GPU else 3e-5 * 30)
    assert y.abs().max().item() <= 30.0 and (y.abs() > 25).any(), "capped, and the cap was reached"


def test_softcap_off_and_dispatch():
    x = torch.randn(4, 9, device=DEVICE).half()
    assert torch.equal(softcap_logits(x, None), x.float())
    assert torch.equal(softcap_logits(x, 30.0, impl="torch"), softcap_reference(x, 30.0))
    with pytest.raises(ValueError, match="unknown impl"):
        softcap_logits(x, 30.0, impl="nope")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("cap", [30.0, None])
def test_softcap_into_buffer(impl, cap):
    """`out=`: the same values land in the leading elements of a larger fp32 buffer (how every CUDA
    graph of a GraphRunner shares one logits buffer); the rest of it is untouched."""
    x = (torch.randn(3, 257, device=DEVICE) * 40).half()
    buf = torch.full((3 * 257 + 11,), 7.0, device=DEVICE)
    y = softcap_logits(x, cap, impl=impl, out=buf)
    assert y.shape == x.shape and y.data_ptr() == buf.data_ptr()
    assert torch.equal(y, softcap_logits(x, cap, impl=impl))
    assert torch.equal(buf[-11:], torch.full((11,), 7.0, device=DEVICE))
    for bad in (torch.empty(10, device=DEVICE), torch.empty(3 * 257, device=DEVICE).half()):
        with pytest.raises(ValueError, match="fp32 buffer"):
            softcap_logits(x, cap, impl=impl, out=bad)
