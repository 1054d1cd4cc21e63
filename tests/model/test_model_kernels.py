"""The runtime on canvasq.kernels' Triton kernels (RMSNorm, W4 MoE), run by the Triton interpreter
on CPU in fp32 (TRITON_INTERPRET must be set before Triton is imported, hence a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {here!r})
    from model_helpers import hf_decode, hf_encode, new_cache, random_model, rel_err, small_shape
    from canvasq.model.runtime import Runtime, Window
    from canvasq.kernels.moe import unpack_w4

    shape = small_shape(hidden_size=128, moe_intermediate_size=64)
    m = random_model(shape)
    v, c, p = shape.vocab_size, shape.canvas_length, 21
    g = torch.Generator().manual_seed(5)
    prompt, canvas = torch.randint(0, v, (p,), generator=g), torch.randint(0, v, (c,), generator=g)
    sc = torch.randn(c, v, generator=g)
    cache = new_cache(m)
    hf_encode(m, cache, prompt, 0)
    ref = hf_decode(m, cache, canvas, p, sc_logits=sc)

    def logits(rt):
        arena = rt.new_arena(1, 64)
        rt.encode(arena, 0, prompt, torch.arange(p))
        return rt.decode(arena, [Window.canvas(0, canvas, p, self_cond=sc)]).logits

    rt = Runtime.from_hf(m, kernels=True)
    assert rt.kernels
    err = rel_err(logits(rt), ref)
    assert err <= 1e-4, err
    w4 = Runtime.from_hf(m, experts="w4", kernels=True)
    with torch.no_grad():  # the same model with its experts replaced by the dequantised W4 weights
        for lw, layer in zip(w4.dec_layers, m.model.decoder.layers):
            gu, dn = unpack_w4(lw.experts_packed, torch.float32)
            layer.experts.gate_up_proj.copy_(gu)
            layer.experts.down_proj.copy_(dn)
    err = rel_err(logits(w4), logits(Runtime.from_hf(m, kernels=False)))
    assert err <= 1e-4, err
    print("ok")
    """
)


@pytest.mark.slow
def test_runtime_on_triton_kernels_interpreted():
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=here)],
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        cwd=str(Path(here).parents[1]),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
