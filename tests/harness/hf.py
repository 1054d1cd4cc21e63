"""HF's own forward as the reference the runtime is compared with."""

from __future__ import annotations

import torch

from canvasq.model.loading import cache_kwargs


def hf_cache(model, prompts: torch.Tensor):
    """The encoder's KV cache of `prompts` [B, P] through HF's encoder, positions 0..P-1 (what HF's
    decoder reads before its first canvas)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config())
    b, p = prompts.shape
    pos = torch.arange(p, device=prompts.device)[None].expand(b, p)
    with torch.no_grad():
        model.model.encoder(input_ids=prompts, position_ids=pos, **cache_kwargs(model.model.encoder, cache))
    return cache
