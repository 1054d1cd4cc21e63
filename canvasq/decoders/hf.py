"""`hf`: Hugging Face `generate()` unchanged — DiffusionGemma's native sampler, the reference arm
(`official` runs the same algorithm on canvasq's runtime).

One canvas at a time, entropy-bounded acceptance, adaptive stopping, the canvas written to the cache
by an encoder pass before the next one starts. This is the baseline every other arm names.

Flow: DecodeBatch → groups of requests needing the same number of canvases → one `generate()` per
group (left padding + attention mask) → per-row truncation to `max_tokens` → DecodeResult.

Traces come from observing generate, never from changing it (`hf_trace.GenerateRecorder`).

Batched ≠ unbatched for this arm, by construction: generate draws every canvas and every sample
with `torch.randint` / `torch.multinomial` over the whole [B, C] batch from one global RNG, so a
row's draws depend on which rows share its call (and requests needing different numbers of canvases
go to separate calls). Runs repeat exactly for the same batch and seed. The step decoders give each
request its own RNG and are batch-invariant.

Note on τ here: the entropy-bound sampler re-decides acceptance over the whole canvas every step and
emits the final argmax canvas, so Σ τ over a canvas is not the number of tokens it produced; report
tokens ÷ forwards for the numerator and read the per-step τ as "how much the sampler kept".
"""

from __future__ import annotations

import math
from collections import defaultdict

from canvasq.decoders.configs import HfConfig
from canvasq.decoders.experts import model_with_experts
from canvasq.decoders.hf_trace import GenerateRecorder
from canvasq.decoders.state import Cancelled, error_result, first_stop, request_error
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    Interrupted,
)


class HfDecoder:
    name = "hf"
    config_cls = HfConfig

    def __init__(self, bundle, config: HfConfig | None = None):
        self.bundle = bundle
        self.config = config or HfConfig()

    def decode(
        self, batch: DecodeBatch, should_stop=None, interrupts: tuple[type[BaseException], ...] = ()
    ) -> list[DecodeResult]:
        import torch

        bundle, C = self.bundle, self.bundle.canvas_length
        results: dict[int, DecodeResult] = {}
        groups: dict[int, list[int]] = defaultdict(list)
        for i, req in enumerate(batch.requests):
            err = request_error(bundle, req)
            if err:
                results[i] = error_result(req, err, self.name)
            else:
                groups[math.ceil(req.max_tokens / C)].append(i)

        model = model_with_experts(bundle.hf_model, self.config.experts)
        self._pass_base = 0
        cancelled = False
        # Seeded like a script would be (`torch.manual_seed(seed)` then generate), without disturbing
        # the caller's global RNG.
        devices = [torch.device(bundle.device)] if str(bundle.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(batch.seed)
            for n_canvases in sorted(groups):
                idx = groups[n_canvases]
                reqs = [batch.requests[i] for i in idx]
                if cancelled:
                    for i, r in zip(idx, reqs):
                        results[i] = error_result(r, CANCELLED, self.name, CANCELLED)
                    continue
                try:
                    out = self._generate_group(model, reqs, n_canvases, should_stop)
                except Cancelled:
                    cancelled = True
                    out = [error_result(r, CANCELLED, self.name, CANCELLED) for r in reqs]
                except interrupts as exc:  # the caller's time limit: hand back the groups that finished
                    raise Interrupted(exc, [res for res in results.values() if not res.error]) from exc
                except Exception as exc:  # noqa: BLE001 — a failed group fails its rows, never the whole batch
                    out = [error_result(r, f"{type(exc).__name__}: {exc}", self.name) for r in reqs]
                for i, res in zip(idx, out):
                    results[i] = res
        return [results[i] for i in range(len(batch.requests))]

    # ------------------------------------------------------------------------------------------
    def _generate_group(self, model, reqs: list[DecodeRequest], n_canvases: int, should_stop):
        import torch

        bundle, C = self.bundle, self.bundle.canvas_length
        L = max(len(r.prompt_ids) for r in reqs)
        B = len(reqs)
        ids = torch.full((B, L), bundle.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(reqs):  # left padding: every canvas starts at the same position
            ids[b, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, L - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(bundle.device), mask.to(bundle.device)

        kwargs = {"max_new_tokens": n_canvases * C}
        if self.config.max_denoising_steps is not None:
            kwargs["max_denoising_steps"] = self.config.max_denoising_steps
        if self.config.entropy_bound is not None:
            from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
                EntropyBoundSamplerConfig,
            )

            kwargs["sampler_config"] = EntropyBoundSamplerConfig(
                entropy_bound=float(self.config.entropy_bound)
            )

        rec = GenerateRecorder(B, C, prompt_rows=[len(r.prompt_ids) for r in reqs], should_stop=should_stop)
        with rec.instrument(model):
            out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        seqs = out.sequences[:, L:].tolist()
        base, self._pass_base = self._pass_base, self._pass_base + len(rec.passes)

        results = []
        for b, r in enumerate(reqs):
            gen = seqs[b]
            cut = first_stop(gen, frozenset({bundle.eos_id, bundle.pad_id}))
            if cut is not None and cut < r.max_tokens:
                tokens, reason = gen[:cut], FinishReason.stop
            else:
                tokens, reason = gen[: r.max_tokens], FinishReason.length
            traces = rec.traces_for(b, base=base)
            results.append(
                DecodeResult(
                    custom_id=r.custom_id,
                    token_ids=tokens,
                    text=bundle.decode_text(tokens),
                    finish_reason=reason,
                    prompt_tokens=len(r.prompt_ids),
                    forwards=len(traces),
                    traces=traces,
                    decoder=self.name,
                )
            )
        return results
