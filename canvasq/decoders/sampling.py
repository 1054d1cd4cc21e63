"""The native sampler's pieces (HF `generate()`'s DiffusionGemma sampler), batched over a group of
requests' canvases: its settings as `generate()` resolves them, the temperature ramp, the draws (HF's
own ops per request, or one fused kernel for the group keyed by `philox_keys`), the entropy-bounded
acceptance, the stopping rule and the next step's self-conditioning. `decoders.official` runs them
over its slot-indexed state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from canvasq.decoders.configs import OfficialConfig
from canvasq.model.windows import to_device

Pick = Callable[[torch.Tensor], torch.Tensor]  # keep [B, C] -> the requests' next inputs [B, C]

_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def philox_key(seed: int, canvas: int, step: int) -> int:
    """A 63-bit Philox key per (request seed, canvas, step): splitmix64 over the three."""
    x = (seed ^ (canvas * _GOLDEN) ^ (step * _MIX1)) & _M64
    x = ((x ^ (x >> 30)) * _MIX1) & _M64
    x = ((x ^ (x >> 27)) * _MIX2) & _M64
    return (x ^ (x >> 31)) >> 1


def philox_keys(seed: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`philox_key` over int64 tensors [B] on their device (no host round trip): int64 products wrap
    modulo 2**64 like the masked ones, and the right shifts are made logical by masking."""

    def i64(c: int) -> int:  # the constant's two's-complement int64 value
        return c - (1 << 64) if c >= 1 << 63 else c

    def shr(x: torch.Tensor, k: int) -> torch.Tensor:
        return (x >> k) & ((1 << (64 - k)) - 1)

    x = seed ^ (canvas * i64(_GOLDEN)) ^ (step * i64(_MIX1))
    x = (x ^ shr(x, 30)) * i64(_MIX1)
    x = (x ^ shr(x, 27)) * i64(_MIX2)
    return shr(x ^ shr(x, 31), 1)


def temperatures(steps_left: torch.Tensor, smp: SamplerSettings) -> torch.Tensor | None:
    """[B] fp32: HF's LinearTemperatureScheduleLogitsProcessor at each request's step (`steps_left`
    int32, N on a canvas's first step: the same dtype path, int32 / N in fp32), or None."""
    if smp.t_min is None:
        return None
    assert smp.t_max is not None  # set with t_min (`SamplerSettings.resolve`)
    return smp.t_min + (smp.t_max - smp.t_min) * (steps_left / smp.steps)


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


class SlotState:
    """The sampler's state of every request in a stream, [slots, ...] on the model's device and a
    request's at its arena slot (gathered and scattered with the live rows' slot index): steps left
    (HF's cur_step), the Philox key's parts, the canvas's next input, the last argmax and the
    argmax history of the stability test, the self-conditioning of the next step."""

    def __init__(self, slots: int, C: int, S: int, sc_k: int | None, V: int, dtype, device):
        def zeros(*shape, dt=torch.long):
            return torch.zeros(slots, *shape, dtype=dt, device=device)

        self.left = zeros(dt=torch.int32)  # HF's cur_step: N on a canvas's first step, 1 on its last
        self.seed, self.canvas = zeros(), zeros()  # the Philox key's request seed and canvas number
        self.tokens = zeros(C)  # the canvas's next input (its `Canvas.tokens` is a view)
        self.argmax = zeros(C)  # the last step's argmax: the canvas's tokens once it stops
        self.history = zeros(S, C) - 1  # the last S argmax canvases (the stability test)
        self.sc = (zeros(C, sc_k), zeros(C, sc_k, dt=dtype)) if sc_k is not None else zeros(C, V, dt=dtype)

    def reset(self, slots: list[int], seeds: list[int], canvases: list[int], steps: int, fresh) -> None:
        """New canvases (`fresh`, `Canvas`es with their x_T) at `slots` (distinct): their state starts
        over, and each canvas's `tokens` becomes a view of its slot's input."""
        dev = self.left.device
        at = to_device(slots, dev)  # no stream sync: neither these copies nor the scalar fills
        bits = [x - (1 << 64) if x >> 63 else x for x in seeds]  # uint64 seeds as int64 bits
        self.seed[at] = to_device(bits, dev)
        self.canvas[at] = to_device(canvases, dev)
        self.left.index_fill_(0, at, steps)
        self.history.index_fill_(0, at, -1)
        self.tokens[at] = torch.stack([cv.tokens for cv in fresh])
        for slot, cv in zip(slots, fresh):
            cv.tokens = self.tokens[slot]

    def put_sc(self, idx: torch.Tensor, sc) -> None:
        """The next step's self-conditioning of slots `idx` (`self_conditioning`'s form)."""
        if isinstance(self.sc, tuple):
            self.sc[0][idx], self.sc[1][idx] = sc
        else:
            self.sc[idx] = sc

    def stopped(self, idx: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor, smp: SamplerSettings):
        """Which canvases of slots `idx` end this step [B]: HF's StableAndConfidentStoppingCriteria
        (`stable_and_confident`, on the slots' argmax history, which it advances) or the step cap."""
        capped = self.left[idx] <= 1
        if smp.stability_threshold is None:
            return capped
        assert smp.confidence_threshold is not None  # set with stability_threshold (`resolve`)
        stopped, self.history[idx] = stable_and_confident(
            self.history[idx], argmax, entropy, smp.confidence_threshold
        )
        return stopped | capped

    def sc_at(self, slot: int):
        """The slot's self-conditioning for its next window (views, written by each step)."""
        return (self.sc[0][slot], self.sc[1][slot]) if isinstance(self.sc, tuple) else self.sc[slot]


def zero_top_k_sc(C: int, k: int | None, dtype: torch.dtype, device) -> tuple | None:
    """A canvas's first-step self-conditioning under top-k SC: a zero top-k signal (ids, values) with
    every row off (`self_cond_rows`), exactly HF's "no logits"; read-only, shared by every window.
    None without top-k SC (`k` None)."""
    if k is None:
        return None
    ids = torch.zeros(C, k, dtype=torch.long, device=device)
    return (ids, ids.to(dtype)), torch.zeros(C, dtype=torch.bool, device=device)


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

    def pick(keep: torch.Tensor) -> torch.Tensor:
        rows = []
        for b, gen in enumerate(gens):
            probs = torch.softmax(logits[b], dim=-1, dtype=torch.float32)
            sample = torch.multinomial(probs, num_samples=1, generator=gen).squeeze(-1)
            noise = torch.randint(0, V, (C,), generator=gen, device=logits.device)
            rows.append(torch.where(keep[b], sample, noise))
        return torch.stack(rows)

    return argmax, entropy, pick


def draw_fused(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    inv_temp: torch.Tensor | None,
    sc_topk: int | None,
    sc_dtype: torch.dtype,
    cap: float | None = None,
    draw: str = "gumbel",
):
    """The same statistics and draws for the whole group in one read of the logits [B, C, V] (no
    per-request softmax, multinomial or temperature pass) with a Philox key per request (`seeds` [B],
    `philox_key`: its draws do not depend on the batch), and the top-k self-conditioning in one more
    read (no sort of the vocabulary). Returns argmax, entropy, pick and the top-k SC (ids, values) or
    None (full-vocabulary SC: the logits are scaled in place for it). `cap`: `logits` is the LM head's
    output before the final soft cap, which the reads apply (top-k SC only). `draw`: the kernel's rule
    ("gumbel" or "invcdf", `softmax_sample`)."""
    from canvasq.kernels import softmax_sample

    B, C, V = logits.shape
    scaled = inv_temp is not None
    if inv_temp is None:
        inv_temp = torch.ones(B, dtype=torch.float32, device=logits.device)
    top_k = sc_topk if sc_topk is not None and sc_topk < V else 0
    assert not cap or top_k, "full-vocabulary self-conditioning reads capped logits"
    out = softmax_sample(logits.reshape(-1, V), inv_temp, seeds, C, top_k=top_k, cap=cap, draw=draw)
    drawn, noise = out.draw.view(B, C), out.noise.view(B, C)
    top = None
    if top_k:
        assert out.top_ids is not None and out.top_vals is not None  # asked for with top_k
        top = (out.top_ids.view(B, C, top_k), out.top_vals.view(B, C, top_k).to(sc_dtype))
    elif scaled:  # full-vocabulary SC reads the scaled logits
        logits.mul_(inv_temp[:, None, None])

    def pick(keep: torch.Tensor) -> torch.Tensor:  # one launch for the group
        return torch.where(keep, drawn, noise)

    return out.argmax.view(B, C), out.entropy.view(B, C), pick, top


def entropy_bound_keep(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """HF's EntropyBoundSampler: accept the lowest-entropy positions of each canvas while
    Σ H − max H ≤ bound; entropy [B, C] -> keep [B, C] bool."""
    sorted_h, order = torch.sort(entropy, dim=-1)
    keep_sorted = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(keep_sorted), -1, order, keep_sorted)


def stable_and_confident(
    history: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor, confidence: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's StableAndConfidentStoppingCriteria over a group: the argmax [B, C] equal to each of the last
    S argmax canvases (`history` [B, S, C], -1 before a canvas's first steps) and the mean entropy
    under `confidence` -> (stopped [B], the history with this argmax shifted in)."""
    stable = (history == argmax[:, None, :]).all(dim=-1).all(dim=-1)
    if history.shape[1]:
        history = torch.cat([history[:, 1:], argmax[:, None, :]], dim=1)
    return stable & (entropy.mean(dim=-1) < confidence), history


def self_conditioning(logits: torch.Tensor, sc_topk: int | None, dtype: torch.dtype):
    """The next step's SC from this step's (temperature-scaled) logits, in the embedding dtype: the
    full logits, or the top-k (ids, values)."""
    if sc_topk is None or sc_topk >= logits.shape[-1]:
        return logits.to(dtype)
    vals, ids = torch.topk(logits, sc_topk, dim=-1)
    return ids, vals.to(dtype)
