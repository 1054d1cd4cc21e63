"""`hf`: Hugging Face `generate()` unchanged — DiffusionGemma's native sampler, the reference arm
(`official` runs the same algorithm on canvasq's runtime).

One canvas at a time, entropy-bounded acceptance, adaptive stopping, the canvas written to the cache
by an encoder pass before the next one starts. This is the baseline every other arm names.

Flow: DecodeBatch → groups of requests needing the same number of canvases → one `generate()` per
group (left padding + attention mask) → per-row truncation to `max_tokens` → DecodeResult.

Traces come from observing generate, never from changing it: the decoder forward and the encoder are
wrapped on the instance (timing, G), the sampler's `accept_canvas` is wrapped (τ = tokens accepted
that step), the adaptive stopper is wrapped in a delegating proxy (which rows are still denoising) and
`_finalize_canvas` is wrapped (which rows have finished). All wrappers are removed on exit.

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

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from canvasq.decoders.configs import HfConfig
from canvasq.decoders.experts import model_with_experts
from canvasq.decoders.state import Cancelled, error_result, first_stop, poll, request_error
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    ForwardTrace,
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

        rec = _Recorder(B, C, prompt_rows=[len(r.prompt_ids) for r in reqs], should_stop=should_stop)
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


@dataclass
class _HfPass:
    """One model pass of a generate() call, per batch row: rows it carried, tokens accepted, live."""

    kind: str  # "decode" | "encode"
    ms: float
    rows: list[int]
    commits: list[int]
    live: list[bool]


class _Recorder:
    """Watches one `generate()` call; keeps the live-row bookkeeping generate keeps internally."""

    def __init__(self, batch_size: int, canvas_length: int, prompt_rows: list[int], should_stop):
        self.B, self.C = batch_size, canvas_length
        self.prompt_rows = prompt_rows
        self.should_stop = should_stop
        self.finished_denoising = [False] * batch_size  # this canvas: the adaptive stopper fired
        self.finished_sequences = [False] * batch_size  # EOS or length reached in an earlier canvas
        self.encoded_prompt = False
        self.passes: list[_HfPass] = []  # one per model pass

    # -- the wrappers ------------------------------------------------------------------------
    @contextlib.contextmanager
    def instrument(self, model):
        """Wrap generate()'s hooks on this instance (never on the class); all removed on exit."""
        encoder = model.model.encoder
        patches = [
            (model, "forward", self._traced_decoder(model.forward)),
            (encoder, "forward", self._traced_encoder(encoder.forward)),
            (model, "_prepare_sampler", self._counting_sampler(model._prepare_sampler)),
            (
                model,
                "_prepare_diffusion_stopping_criteria",
                self._mirrored_stopper(model._prepare_diffusion_stopping_criteria),
            ),
            (model, "_finalize_canvas", self._watched_finalize(model._finalize_canvas)),
        ]
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        try:
            yield self
        finally:
            for obj, name, _ in patches:
                obj.__dict__.pop(name, None)

    def _traced_decoder(self, orig):
        def forward(*args, **kwargs):
            poll(self.should_stop)
            live = [not (d or s) for d, s in zip(self.finished_denoising, self.finished_sequences)]
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            _sync(out.logits)
            ms = (time.perf_counter() - t0) * 1e3
            self.passes.append(_HfPass("decode", ms, [self.C if x else 0 for x in live], [0] * self.B, live))
            return out

        return forward

    def _traced_encoder(self, orig):
        def encoder_forward(*args, **kwargs):
            poll(self.should_stop)
            alive = [not s for s in self.finished_sequences]
            rows = [self.C if a else 0 for a in alive] if self.encoded_prompt else list(self.prompt_rows)
            self.encoded_prompt = True
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            _sync(out.last_hidden_state)
            ms = (time.perf_counter() - t0) * 1e3
            self.passes.append(_HfPass("encode", ms, rows, [0] * self.B, alive))
            return out

        return encoder_forward

    def _counting_sampler(self, orig):
        """The sampler, its `accept_canvas` counting the accepted positions of the last decode pass."""

        def prepare_sampler(*args, **kwargs):
            sampler = orig(*args, **kwargs)
            orig_accept = sampler.accept_canvas

            def accept_canvas(*a, **k):
                accepted = orig_accept(*a, **k)
                last = self.passes[-1] if self.passes else None
                if last is not None and last.kind == "decode":
                    counts = sampler.accepted_token_mask.sum(dim=-1).tolist()
                    last.commits = [int(c) if lv else 0 for c, lv in zip(counts, last.live)]
                return accepted

            sampler.accept_canvas = accept_canvas
            return sampler

        return prepare_sampler

    def _mirrored_stopper(self, orig):
        def prepare_stopper(*args, **kwargs):
            inner = orig(*args, **kwargs)
            return None if inner is None else _StopperProxy(inner, self)

        return prepare_stopper

    def _watched_finalize(self, orig):
        def finalize(*args, **kwargs):
            input_ids, finished = orig(*args, **kwargs)
            self.finished_sequences = [bool(x) for x in finished.tolist()]
            return input_ids, finished

        return finalize

    # -- results -----------------------------------------------------------------------------
    def traces_for(self, b: int, base: int = 0) -> list[ForwardTrace]:
        """The passes that served row `b` (HF counts a row's decoder passes only while it is still
        denoising; encoder passes count while its sequence is unfinished)."""
        out = []
        for i, p in enumerate(self.passes):
            if not p.live[b]:
                continue
            out.append(
                ForwardTrace(
                    index=base + i,  # indices run on across the groups of one batch
                    rows=sum(p.rows),
                    commits=sum(p.commits),
                    canvases=sum(1 for x in p.live if x),
                    states=("full," * sum(1 for x in p.live if x)).rstrip(","),
                    ms=p.ms,
                    kind=p.kind,
                    own_rows=p.rows[b],
                    own_commits=p.commits[b],
                )
            )
        return out


class _StopperProxy:
    """Delegates to HF's adaptive stopper and mirrors its per-row decisions (an object's `__call__`
    is looked up on the type, so the proxy is a class, not a patched attribute)."""

    def __init__(self, inner, rec: _Recorder):
        self.inner, self.rec = inner, rec

    def __call__(self, argmax_canvas, logits, **kwargs):
        stop = self.inner(argmax_canvas, logits, **kwargs)
        self.rec.finished_denoising = [
            a or bool(s) for a, s in zip(self.rec.finished_denoising, stop.tolist())
        ]
        return stop

    def reset(self):
        self.rec.finished_denoising = [False] * self.rec.B
        self.inner.reset()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sync(t) -> None:
    if t is not None and t.is_cuda:
        import torch

        torch.cuda.synchronize(t.device)
