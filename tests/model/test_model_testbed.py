"""The runtime on the committed testbed checkpoint (skipped until `models/testbed` holds one), the
W4 expert path, and the real-shape config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import hf_decode, hf_encode, new_cache, random_model, rel_err, small_shape

from canvasq.model.runtime import Runtime, Window

TESTBED = Path(__file__).resolve().parents[2] / "models" / "testbed"


@pytest.mark.skipif(not (TESTBED / "config.json").exists(), reason="no committed testbed checkpoint")
def test_testbed_checkpoint_matches_hf():
    from canvasq.model.loading import load_bundle

    bundle = load_bundle(str(TESTBED), device="cpu", dtype=torch.float32)
    models = [bundle.hf_model]
    if bundle.adapter_dir is not None:
        models.append(bundle.d2f_model())  # merged LoRA: encoder and decoder weights may differ
    g = torch.Generator().manual_seed(0)
    for m in models:
        rt = Runtime.from_hf(m)
        v, c = rt.vocab_size, bundle.canvas_length
        prompt = torch.randint(5, v, (70,), generator=g)  # longer than the sliding window
        canvases = [torch.randint(5, v, (c,), generator=g) for _ in range(2)]
        cache = new_cache(m)
        arena = rt.new_arena(1, 256)
        hf_encode(m, cache, prompt, 0)
        rt.encode(arena, 0, prompt, torch.arange(70))
        sc = torch.randn(c, v, generator=g) * 3
        ref = hf_decode(m, cache, canvases[0], 70, sc_logits=sc)
        out = rt.decode(arena, [Window.canvas(0, canvases[0], 70, self_cond=sc)])
        assert rel_err(out.logits, ref) <= 1e-4
        hf_encode(m, cache, canvases[0], 70)
        rt.encode(arena, 0, canvases[0], torch.arange(70, 70 + c))
        ref = hf_decode(m, cache, canvases[1], 70 + c)
        out = rt.decode(arena, [Window.canvas(0, canvases[1], 70 + c)])
        assert rel_err(out.logits, ref) <= 1e-4


def test_w4_experts_match_dequantised_reference():
    """experts="w4" equals the torch runtime run on the dequantised experts (the W4 kernel itself is
    tested in tests/kernels against the same twin)."""
    pytest.importorskip("canvasq.kernels.moe")
    from canvasq.kernels.moe import unpack_w4

    shape = small_shape(hidden_size=128, moe_intermediate_size=64)
    m = random_model(shape)
    rt4 = Runtime.from_hf(m, experts="w4")
    m2 = random_model(shape)  # same seed, same weights; swap in the dequantised experts
    with torch.no_grad():
        for layer4, layer in zip(rt4.dec_layers, m2.model.decoder.layers):
            gu, dn = unpack_w4(layer4.experts_packed, torch.float32)
            layer.experts.gate_up_proj.copy_(gu)
            layer.experts.down_proj.copy_(dn)
    rt = Runtime.from_hf(m2)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape.vocab_size, (20,), generator=g)
    canvas = torch.randint(0, shape.vocab_size, (shape.canvas_length,), generator=g)
    outs = []
    for r in (rt4, rt):
        arena = r.new_arena(1, 64)
        r.encode(arena, 0, prompt, torch.arange(20))
        outs.append(r.decode(arena, [Window.canvas(0, canvas, 20)]).logits)
    assert rel_err(outs[0], outs[1]) <= 1e-4
    # and W4 is not a no-op: the bf16 experts give different logits
    arena = Runtime.from_hf(m).new_arena(1, 64)
    rt_plain = Runtime.from_hf(m)
    rt_plain.encode(arena, 0, prompt, torch.arange(20))
    assert rel_err(rt_plain.decode(arena, [Window.canvas(0, canvas, 20)]).logits, outs[0]) > 1e-4


def test_real_shape_config():
    from canvasq.model.shapes import REAL_26B_A4B, build_config

    cfg = build_config(REAL_26B_A4B)
    tc = cfg.text_config
    assert tc.layer_types.count("full_attention") == 5 and tc.layer_types[-1] == "full_attention"
    counts = REAL_26B_A4B.param_counts()
    assert 25.0e9 < counts["total"] < 25.5e9 and 22.7e9 < counts["experts"] < 22.9e9
    with torch.device("meta"):
        from transformers import DiffusionGemmaForBlockDiffusion

        m = DiffusionGemmaForBlockDiffusion._from_config(cfg, dtype=torch.bfloat16)
    text = sum(p.numel() for n, p in m.named_parameters() if "vision" not in n)
    assert abs(text - counts["total"]) / counts["total"] < 1e-3
    full = m.model.decoder.layers[5].self_attn
    assert full.v_proj is None and full.k_proj.weight.shape == (2 * 512, 2816)
    assert m.model.decoder.layers[0].self_attn.k_proj.weight.shape == (8 * 256, 2816)


def test_decode_text_cuts_at_eos_and_drops_pad():
    """An answer's text: the ids before the first EOS, PAD dropped; ids after EOS never appear."""
    from canvasq.model.loading import load_bundle

    testbed = load_bundle()
    eos, pad = testbed.eos_id, testbed.pad_id
    a, b, c = [i for i in range(40, 60) if i not in (eos, pad)][:3]
    tok = testbed.tokenizer
    want = tok.decode([a, b, c], skip_special_tokens=True)
    assert testbed.decode_text(torch.tensor([a, pad, b, c, eos, a, a])) == want
    assert testbed.decode_text([a, b, pad, c]) == want
    assert testbed.decode_text([eos, a]) == ""
