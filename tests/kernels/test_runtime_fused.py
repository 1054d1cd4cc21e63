"""The runtime with its fused norm kernels (Triton; interpreted on CPU) against HF's forward, fp32."""

import sys
from pathlib import Path

import torch

from canvasq.model.loading import load_bundle
from canvasq.model.runtime import Runtime, Window

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.forward import hf_cache, rel_err  # noqa: E402


@torch.no_grad()
def test_runtime_with_fused_kernels_matches_hf_fp32():
    m = load_bundle(device="cpu").hf_model  # the trained testbed, fp32
    g = torch.Generator().manual_seed(0)
    p, c = 30, m.config.canvas_length
    prompts = torch.randint(5, 700, (2, p), generator=g)
    canvas = torch.randint(5, 700, (2, c), generator=g)
    cache = hf_cache(m, prompts)
    pos = torch.arange(p, p + c)[None].expand(2, c)
    ref = m(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=pos).logits
    rt = Runtime.from_hf(m, kernels=True)  # q/k norm + RoPE and residual norms through the Triton kernels
    arena = rt.new_arena(2, 128)
    rt.encode_many(arena, [(i, prompts[i], torch.arange(p)) for i in range(2)])
    out = rt.decode(arena, [Window.canvas(i, canvas[i], p) for i in range(2)]).logits
    assert rel_err(out, ref.reshape(2 * c, -1)) <= 1e-4
