"""Shared builders for the model parity tests: small random DiffusionGemma models and HF reference
calls (the same calls on transformers 5.17 and 5.24)."""

from __future__ import annotations

import torch

from canvasq.model.loading import cache_kwargs
from canvasq.model.shapes import ModelShape, build_config, toy_shape


def small_shape(**kw) -> ModelShape:
    return toy_shape(**{"vocab_size": 160, **kw})


@torch.no_grad()
def random_model(shape: ModelShape, seed: int = 0, dtype=torch.float32):
    """An HF model with every weight non-trivial: norm weights, router scales and per-expert scales
    drawn around 1, and encoder / decoder `layer_scalar` buffers (not tied by HF) drawn apart."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(build_config(shape)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "vision" in name or "embed_vision" in name:
            continue
        if p.dim() == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.to(dtype)


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config())


@torch.no_grad()
def hf_encode(model, cache, ids: torch.Tensor, start: int) -> None:
    """HF encoder pass of ids [R] at positions start.. into `cache` (prompt or committed canvas)."""
    pos = torch.arange(start, start + ids.numel())[None]
    model.model.encoder(input_ids=ids[None], position_ids=pos, **cache_kwargs(model.model.encoder, cache))


@torch.no_grad()
def hf_decode(model, cache, canvas: torch.Tensor, start: int, sc_logits=None, mask=None) -> torch.Tensor:
    """HF decoder logits [R, V] for one canvas at positions start.. over the encoder cache."""
    pos = torch.arange(start, start + canvas.numel())[None]
    out = model(
        decoder_input_ids=canvas[None],
        **cache_kwargs(model, cache),
        decoder_position_ids=pos,
        self_conditioning_logits=None if sc_logits is None else sc_logits[None],
        decoder_attention_mask=mask,
    )
    return out.logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
