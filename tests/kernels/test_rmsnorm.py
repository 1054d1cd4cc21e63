"""Fused RMSNorm vs HF's formula (weight, not 1 + weight; and the with_scale=False variant)."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU, poison, rel_err

from canvasq.kernels.rmsnorm import rms_norm, rms_norm_launch, rms_norm_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 256), (7, 300), (3, 5, 64), (33, 2816)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_parity(shape, dtype, with_weight):
    x = (torch.randn(shape, device=DEVICE) * 3 + 0.5).to(dtype)
    w = (torch.randn(shape[-1], device=DEVICE) * 0.2 + 1).to(dtype) if with_weight else None
    out = poison(x.shape, dtype)
    y = rms_norm_launch(x, w, 1e-6, out=out)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, rms_norm_reference(x, w, 1e-6)) < TOL[dtype]
    assert torch.equal(y, rms_norm_launch(x, w, 1e-6)), "deterministic"


def test_matches_hf_module():
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaRMSNorm

    for with_scale in (True, False):
        mod = DiffusionGemmaRMSNorm(96, eps=1e-6, with_scale=with_scale).to(DEVICE)
        if with_scale:
            with torch.no_grad():
                mod.weight.copy_(torch.randn(96) * 0.3 + 1)
        x = torch.randn(11, 96, device=DEVICE)
        w = mod.weight if with_scale else None
        ref = mod(x)
        assert rel_err(rms_norm(x, w, 1e-6, impl="triton"), ref) < 1e-5
        assert rel_err(rms_norm(x, w, 1e-6, impl="torch"), ref) < 1e-6


def test_strided_input():
    x = torch.randn(6, 2 * 128, device=DEVICE)[:, ::2]  # last-dim stride 2: launcher copies
    assert rel_err(rms_norm_launch(x, None, 1e-6), rms_norm_reference(x, None)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_rms_norm_bf16_real_shape():
    x = torch.randn(256, 2816, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2816, device="cuda", dtype=torch.bfloat16)
    assert rel_err(rms_norm(x, w), rms_norm_reference(x, w)) < TOL[torch.bfloat16]
