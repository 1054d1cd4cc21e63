"""The native sampler's pieces (HF `generate()`'s DiffusionGemma sampler), batched over a group of
requests' canvases: its settings as `generate()` resolves them, the draws (HF's own ops per request,
or one fused kernel for the group), the entropy-bounded acceptance and the next step's
self-conditioning. `decoders.official` runs them in its decode loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from canvasq.decoders.configs import OfficialConfig

Pick = Callable[[torch.Tensor], Sequence[torch.Tensor]]  # keep [B, C] -> each request's next input [C]


def philox_key(seed: int, canvas: int, step: int) -> int:
    """A 63-bit Philox key per (request seed, canvas, step): splitmix64 over the three."""
    x = (seed ^ (canvas * 0x9E3779B97F4A7C15) ^ (step * 0xBF58476D1CE4E5B9)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


@dataclass(frozen=True)
class SamplerSettings:
    """The knobs of `generate()`'s sampler, resolved like `generate()` resolves them."""

    steps: int
    entropy_bound: float
    t_min: float | None
    t_max: float | None
    stability_threshold: int | None
    confidence_threshold: float | None

    @classmethod
    def resolve(cls, hf_model, config: OfficialConfig) -> SamplerSettings:
        """Our overrides on top of the checkpoint's generation config and HF's defaults (HF's own
        `_prepare_generation_config`, so a checkpoint's `generation_config.json` counts the same)."""
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        kw = {}
        for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
            if getattr(config, name) is not None:
                kw[name] = getattr(config, name)
        if config.entropy_bound is not None:
            kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(config.entropy_bound))
        gc, _ = hf_model._prepare_generation_config(None, **kw)
        with_temps = gc.t_min is not None and gc.t_max is not None
        with_stop = gc.stability_threshold is not None and gc.confidence_threshold is not None
        return cls(
            steps=int(gc.max_denoising_steps),
            entropy_bound=float(gc.sampler_config.entropy_bound),
            t_min=gc.t_min if with_temps else None,
            t_max=gc.t_max if with_temps else None,
            stability_threshold=gc.stability_threshold if with_stop else None,
            confidence_threshold=gc.confidence_threshold if with_stop else None,
        )


def draw_torch(logits: torch.Tensor, gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, Pick]:
    """logits [B, C, V] (temperature-scaled) -> argmax [B, C], entropy [B, C] and pick(keep [B, C]):
    each request's next input, the draw where kept and the renoise elsewhere, drawn per request on its
    generator in HF's order (multinomial over the canvas, then renoise)."""
    B, C, V = logits.shape
    if logits.is_cuda:  # one fused read of the [rows, V] logits (bf16-noise equal to HF's ops)
        from canvasq.kernels import softmax_argmax

        _, arg, ent = softmax_argmax(logits.reshape(-1, V))
        argmax, entropy = arg.view(B, C), ent.view(B, C)
    else:  # HF's exact ops: the CPU parity test compares tokens
        argmax = logits.argmax(dim=-1)
        entropy = torch.distributions.Categorical(logits=logits, validate_args=False).entropy()

    def pick(keep: torch.Tensor) -> list[torch.Tensor]:
        rows = []
        for b, gen in enumerate(gens):
            probs = torch.softmax(logits[b], dim=-1, dtype=torch.float32)
            sample = torch.multinomial(probs, num_samples=1, generator=gen).squeeze(-1)
            noise = torch.randint(0, V, (C,), generator=gen, device=logits.device)
            rows.append(torch.where(keep[b], sample, noise))
        return rows

    return argmax, entropy, pick


def draw_fused(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    inv_temp: torch.Tensor | None,
    sc_topk: int | None,
    sc_dtype: torch.dtype,
):
    """The same statistics and draws for the whole group in one read of the logits [B, C, V] (no
    per-request softmax, multinomial or temperature pass) with a Philox key per request (`seeds` [B],
    `philox_key`: its draws do not depend on the batch), and the top-k self-conditioning in one more
    read (no sort of the vocabulary). Returns argmax, entropy, pick and the top-k SC (ids, values) or
    None (full-vocabulary SC: the logits are scaled in place for it)."""
    from canvasq.kernels import softmax_sample

    B, C, V = logits.shape
    scaled = inv_temp is not None
    if inv_temp is None:
        inv_temp = torch.ones(B, dtype=torch.float32, device=logits.device)
    top_k = sc_topk if sc_topk is not None and sc_topk < V else 0
    out = softmax_sample(logits.reshape(-1, V), inv_temp, seeds, C, top_k=top_k)
    draw, noise = out.draw.view(B, C), out.noise.view(B, C)
    top = None
    if top_k:
        assert out.top_ids is not None and out.top_vals is not None  # asked for with top_k
        top = (out.top_ids.view(B, C, top_k), out.top_vals.view(B, C, top_k).to(sc_dtype))
    elif scaled:  # full-vocabulary SC reads the scaled logits
        logits.mul_(inv_temp[:, None, None])

    def pick(keep: torch.Tensor) -> tuple[torch.Tensor, ...]:  # one launch for the group
        return torch.where(keep, draw, noise).unbind(0)

    return out.argmax.view(B, C), out.entropy.view(B, C), pick, top


def entropy_bound_keep(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """HF's EntropyBoundSampler: accept the lowest-entropy positions of each canvas while
    Σ H − max H ≤ bound; entropy [B, C] -> keep [B, C] bool."""
    sorted_h, order = torch.sort(entropy, dim=-1)
    keep_sorted = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(keep_sorted), -1, order, keep_sorted)


def self_conditioning(logits: torch.Tensor, sc_topk: int | None, dtype: torch.dtype):
    """The next step's SC from this step's (temperature-scaled) logits, in the embedding dtype: the
    full logits, or the top-k (ids, values)."""
    if sc_topk is None or sc_topk >= logits.shape[-1]:
        return logits.to(dtype)
    vals, ids = torch.topk(logits, sc_topk, dim=-1)
    return ids, vals.to(dtype)
