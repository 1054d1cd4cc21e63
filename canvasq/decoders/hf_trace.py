"""Traces of an unchanged HF `generate()` call, observed from outside (the `hf` arm, decoders/hf.py).

The decoder forward and the encoder are wrapped on the instance (time with a device sync per pass, G),
the sampler's `accept_canvas` is wrapped (τ = tokens accepted that step), the adaptive stopper is
wrapped in a delegating proxy (which rows are still denoising) and `_finalize_canvas` is wrapped
(which rows have finished). `GenerateRecorder.instrument` removes every wrapper on exit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from canvasq.decoders.state import poll
from canvasq.decoders.types import ForwardTrace


@dataclass
class _HfPass:
    """One model pass of a generate() call, per batch row: rows it carried, tokens accepted, live."""

    kind: str  # "decode" | "encode"
    ms: float
    rows: list[int]
    commits: list[int]
    live: list[bool]


class GenerateRecorder:
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

    def __init__(self, inner, rec: GenerateRecorder):
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
