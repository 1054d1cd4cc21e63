"""Fused softmax confidence + argmax + entropy vs the materialising torch path."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU

from canvasq.kernels.softmax_argmax import softmax_argmax, softmax_argmax_launch, softmax_argmax_reference


def _logits(R, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, V, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,V", [(1, 1000), (3, 5003), (17, 4096), (2, 40000)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_parity(R, V, dtype, temperature):
    logits = _logits(R, V, dtype, seed=R * V)
    conf, arg, ent = softmax_argmax_launch(logits, temperature)
    c2, a2, e2 = softmax_argmax_reference(logits, temperature)
    assert torch.equal(arg, a2)
    assert ((conf - c2).abs() / c2).max() < 1e-4
    assert (ent - e2).abs().max() < 1e-4 * max(1.0, e2.abs().max().item())
    again = softmax_argmax_launch(logits, temperature)
    assert all(torch.equal(a, b) for a, b in zip((conf, arg, ent), again)), "deterministic"


def test_ties_masks_and_peaks():
    logits = _logits(4, 3000, torch.float32, seed=1)
    logits[0, 17] = logits[0, 2500] = 50.0  # tie: first index wins, as torch.argmax
    logits[1, :2990] = float("-inf")  # masked vocabulary
    logits[2] = 0.0  # uniform: entropy log V, confidence 1/V
    logits[3, 1234] = 1e4  # one-hot: confidence 1, entropy 0
    conf, arg, ent = softmax_argmax(logits, impl="triton")
    c2, a2, e2 = softmax_argmax_reference(logits)
    assert arg.tolist()[0] == 17 and torch.equal(arg, a2)
    assert torch.allclose(conf, c2, rtol=1e-5) and torch.allclose(ent, e2, atol=1e-5)
    assert abs(ent[2].item() - torch.log(torch.tensor(3000.0)).item()) < 1e-4
    assert conf[3].item() == 1.0 and abs(ent[3].item()) < 1e-6
    assert torch.isfinite(ent).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_real_vocab_bf16():
    logits = _logits(256, 262144, torch.bfloat16, seed=0)
    conf, arg, ent = softmax_argmax(logits)
    c2, a2, e2 = softmax_argmax_reference(logits)
    assert torch.equal(arg, a2) and ((conf - c2).abs() / c2).max() < 1e-3 and (ent - e2).abs().max() < 1e-3
