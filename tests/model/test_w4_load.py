"""W4 experts packed at load (`load_bundle(experts="w4")`) on the testbed, CPU fp32: the packs are
cached on disk and read back without packing, the runtime uses the installed packs (no BF16 experts
left to read), and HF's own forward, the D2F merge copy and every decoder still run."""

from __future__ import annotations

import pytest
import torch
from model_helpers import hf_decode, hf_encode, new_cache

from canvasq.decoders import run_batch
from canvasq.decoders.types import DecodeBatch, DecodeRequest
from canvasq.kernels.moe import store
from canvasq.model.loading import DEFAULT_MODEL_DIR, load_bundle, w4_cache_path
from canvasq.model.runtime import Runtime, Window

TESTBED = str(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("w4cache")


@pytest.fixture(scope="module")
def packed(cache_dir):
    return load_bundle(TESTBED, "cpu", experts="w4", cache_dir=str(cache_dir))


def _logits(rt: Runtime, prompt: torch.Tensor, canvas: torch.Tensor) -> torch.Tensor:
    arena = rt.new_arena(1, 128)
    rt.encode(arena, 0, prompt, torch.arange(prompt.numel()))
    return rt.decode(arena, [Window.canvas(0, canvas, prompt.numel())]).logits


def _inputs(vocab: int, canvas_length: int):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (19,), generator=g), torch.randint(0, vocab, (canvas_length,), generator=g)


def test_packing_at_load_frees_bf16_and_writes_the_cache(packed, cache_dir):
    path = w4_cache_path(TESTBED, torch.float32, cache_dir)
    assert path.is_file() and path.parent.parent == cache_dir
    experts = [m for m in packed.hf_model.modules() if hasattr(m, "w4_experts")]
    assert len(experts) == 2 * packed.config.get_text_config().num_hidden_layers  # encoder + decoder
    assert all(not hasattr(m, "gate_up_proj") and not hasattr(m, "down_proj") for m in experts)
    assert packed.experts == "w4" and packed.engine()["w4_modules"] == len(experts)


def test_cache_load_equals_fresh_packing_and_does_not_pack(packed, cache_dir, monkeypatch):
    def no_packing(*a, **k):
        raise AssertionError("packed again although the cache exists")

    monkeypatch.setattr(store, "pack_w4", no_packing)
    again = load_bundle(TESTBED, "cpu", experts="w4", cache_dir=str(cache_dir))
    monkeypatch.undo()
    plain = load_bundle(TESTBED, "cpu")  # BF16 experts kept: the runtime packs them itself
    prompt, canvas = _inputs(packed.config.get_text_config().vocab_size, packed.canvas_length)
    fresh = _logits(Runtime.from_hf(packed.hf_model, experts="w4"), prompt, canvas)
    cached = _logits(Runtime.from_hf(again.hf_model, experts="w4"), prompt, canvas)
    from_bf16 = _logits(Runtime.from_hf(plain.hf_model, experts="w4"), prompt, canvas)
    assert torch.equal(fresh, cached)
    assert torch.equal(fresh, from_bf16)
    bf16 = _logits(Runtime.from_hf(plain.hf_model), prompt, canvas)
    assert not torch.equal(fresh, bf16)  # the packs are really what ran


def test_runtime_uses_installed_packs_and_hf_forward_runs_them(packed):
    rt = Runtime.from_hf(packed.hf_model, experts="w4")
    installed = {id(m.w4_experts) for m in packed.hf_model.modules() if hasattr(m, "w4_experts")}
    assert {id(lw.experts_packed) for lw in rt.enc_layers + rt.dec_layers} == installed
    with pytest.raises(ValueError, match="CANVASQ_EXPERTS=bf16"):
        Runtime.from_hf(packed.hf_model, experts="bf16")
    # HF's forward goes through the swapped-in W4 experts: it agrees with the runtime's W4 forward
    prompt, canvas = _inputs(packed.config.get_text_config().vocab_size, packed.canvas_length)
    cache = new_cache(packed.hf_model)
    hf_encode(packed.hf_model, cache, prompt, 0)
    ref = hf_decode(packed.hf_model, cache, canvas, prompt.numel())
    torch.testing.assert_close(_logits(rt, prompt, canvas), ref.float(), rtol=1e-3, atol=1e-3)


def test_d2f_copy_shares_the_packs(packed):
    d2f = packed.d2f_model()
    assert d2f is not packed.hf_model
    ours = [m.w4_experts for m in packed.hf_model.modules() if hasattr(m, "w4_experts")]
    theirs = [m.w4_experts for m in d2f.modules() if hasattr(m, "w4_experts")]
    assert len(theirs) == len(ours) and all(a is b for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("decoder", ["official", "pipe", "funnel"])
def test_every_decoder_runs_on_a_packed_model(packed, decoder):
    prompt = packed.encode_prompt(
        "Ann has 12 apples. She finds 3 more apples. How many apples does Ann have now?"
    )
    batch = DecodeBatch([DecodeRequest("a", prompt, 16, "math")], seed=0)
    (res,) = run_batch(packed, batch, decoder, experts="w4")
    assert res.error is None and res.token_ids and res.forwards > 0
