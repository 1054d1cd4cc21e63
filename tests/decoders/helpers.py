"""Small DiffusionGemma models and bundles for the decoder invariant tests."""

from __future__ import annotations

from pathlib import Path

import torch

from canvasq.model.loading import ModelBundle
from canvasq.model.shapes import ModelShape, build_config, toy_shape

TESTBED_DIR = Path(__file__).resolve().parents[2] / "models" / "testbed"


def tiny_shape(**kw) -> ModelShape:
    """Every structural feature at toy size; sliding window 16 < prompt + two canvases of 8."""
    return toy_shape(**{"vocab_size": 96, **kw})


@torch.no_grad()
def tiny_model(shape: ModelShape | None = None, seed: int = 0, peak: float = 1.0):
    """A random model whose weights are all non-trivial; `peak` scales the tied embedding so the
    output distribution is sharper (confidence spread over (0, 1), like a half-trained denoiser)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(build_config(shape or tiny_shape())).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "vision" in name:
            continue
        if p.dim() == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5))
    model.lm_head.weight.mul_(peak)  # tied with the embeddings
    return model


def tiny_bundle(seed: int = 0, peak: float = 1.0, **shape_kw) -> ModelBundle:
    return ModelBundle(tiny_model(tiny_shape(**shape_kw), seed, peak), None, f"tiny:{seed}", "cpu")


def trained_testbed() -> bool:
    """The committed testbed checkpoint exists and is marked trained (not the placeholder)."""
    if not (TESTBED_DIR / "config.json").exists():
        return False
    return any(TESTBED_DIR.glob("train_report*.json"))


def stop_that_raises(exc_type: type[BaseException]):
    """A `should_stop` that counts its calls (`calls["n"]`) and raises `exc_type()` at call number
    `calls["limit_at"]` (None: never), the way a signal-driven time limit fires between forwards."""
    calls = {"n": 0, "limit_at": None}

    def should_stop() -> bool:
        calls["n"] += 1
        if calls["n"] == calls["limit_at"]:
            raise exc_type()
        return False

    return should_stop, calls
