"""The FP8 path's experts on the W4 pack's own weights (`model.fp8.W4A8Experts`, CANVASQ_FP8_GROUPED=w4a8): the
per-token definition on the pack dequantised, the runtime's install from a W4 load, and (on a GPU)
the W4A8 kernels with the quantisers' group sums against the twin."""

from __future__ import annotations

import pytest
import torch

from canvasq.kernels.moe.quant import W4Config, pack_w4, unpack_w4
from canvasq.model.fp8 import (
    FP8Experts,
    W4A8Experts,
    fp8_moe,
    fp8_supported,
    install_fp8,
    parse_grouped,
)
from tests.model.test_fp8 import _logits, _loop_moe


def _pack(seed: int, e: int, h: int, i: int, device="cpu", scale_dtype=None):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    cfg = W4Config(group_gate_up=64, group_down=64, scale_dtype=scale_dtype)
    return pack_w4(gate_up, down, cfg).to(device), g


def test_w4a8_experts_are_the_per_token_definition_on_the_pack_dequantised():
    packed, g = _pack(1, 6, 128, 64)
    n, k = 20, 3
    x = torch.randn(n, 128, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    ex = W4A8Experts.from_w4(packed)
    assert ex.groups() == (64, 64) and ex.nbytes() == 0  # an untiled pack is read where it is
    gu, dn = unpack_w4(packed, torch.float32)
    exact = FP8Experts(gu, torch.ones(gu.shape[:2]), dn, torch.ones(dn.shape[:2]))  # no e4m3 weights
    torch.testing.assert_close(fp8_moe(x, ids, w, ex, kernel=False), _loop_moe(x, ids, w, exact))


def test_the_setting_names_w4a8_and_needs_the_pack():
    assert parse_grouped("W4A8") == "w4a8"
    with pytest.raises(ValueError, match="CANVASQ_FP8_GROUPED='bogus'.*w4a8"):
        parse_grouped("bogus")


@torch.no_grad()
def test_the_runtime_takes_the_pack_as_w4a8_experts_and_refuses_bf16_experts():
    from canvasq.model.loading import load_bundle
    from canvasq.model.runtime import Runtime

    model = load_bundle(device="cpu").hf_model
    g = torch.Generator().manual_seed(3)
    vocab = model.config.get_text_config().vocab_size
    prompt, canvas = torch.randint(5, vocab, (12,), generator=g), torch.randint(5, vocab, (32,), generator=g)
    with pytest.raises(ValueError, match="CANVASQ_FP8_GROUPED=w4a8"):
        install_fp8(Runtime.from_hf(model, experts="reference", kernels=False), ("experts",), 1, "w4a8")
    w4 = Runtime.from_hf(model, experts="w4", kernels=False)
    want = _logits(w4, prompt, canvas)
    install_fp8(w4, ("experts",), 1, "w4a8")
    assert all(isinstance(lw.fp8["experts"], W4A8Experts) for lw in w4.dec_layers)
    got = _logits(w4, prompt, canvas)
    assert not torch.equal(got, want)  # the rows are e4m3 now, the weights the pack's
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["triton", "wgmma_on_sm90"])
def test_w4a8_kernels_match_the_twin_on_gpu(scale_dtype):
    if not fp8_supported("cuda"):
        pytest.skip("no e4m3 tensor cores on this GPU")
    packed, g = _pack(5, 16, 256, 128, "cuda", scale_dtype)
    n, k = 300, 4
    x = torch.randn(n, 256, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(n)]).to("cuda")
    w = torch.rand(n, k, generator=g).to("cuda")
    ex = W4A8Experts.from_w4(packed)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert ex.gate_up.wgmma == ex.down.wgmma == (sm90 and scale_dtype == torch.bfloat16)
    fast, twin = fp8_moe(x, ids, w, ex, kernel=True), fp8_moe(x, ids, w, ex, kernel=False)
    assert (fast.float() - twin.float()).abs().max() / twin.float().abs().max() < 2e-2
