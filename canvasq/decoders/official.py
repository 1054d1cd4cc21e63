"""`official`: DiffusionGemma's native sampler — the algorithm of HF `generate()` — on canvasq's runtime
(own forward, KV arena, W4 experts, CUDA graphs). `hf` keeps HF `generate()` itself as the reference.

Per request, one canvas at a time, exactly as `generate()` does it:

    encode the prompt (later: the finished canvas) into the cache
    canvas x ~ U(V), no self-conditioning, N = max_denoising_steps
    for step n = N .. 1:
        logits = decoder(x, SC)  / T(n),  T(n) = t_min + (t_max - t_min) * n / N
        sample  x_D ~ softmax(logits);  argmax a = argmax(logits);  entropy H per position
        accept  the lowest-entropy positions while  Σ H − max H ≤ entropy_bound  (every position is
                re-decided every step: nothing is final until the canvas ends)
        x       = x_D at the accepted positions, a fresh U(V) draw everywhere else
        stop    when a has not changed for `stability_threshold` steps and mean H < confidence_threshold
        SC     = logits (the next step's self-conditioning)
    the canvas's tokens are the last argmax a; EOS (or PAD) in it ends the answer

What differs from `generate()` is only batching: a request that stops denoising leaves the forward
(HF keeps computing it and discards the result), requests advance through their canvases
independently, and each draws from its own generator (`seed_mode="row"`: output does not depend on
which requests share the batch). With `seed_mode="plain"` and `sc_topk=None`, a batch of one draws
exactly what `torch.manual_seed(seed); model.generate(...)` draws, so the tokens are the same (the
parity test). `sc_topk=k` self-conditions on the top-k of the previous logits instead of the full
vocabulary (runtime's top-k projection).

Sampler statistics run batched over the live requests, in groups whose [rows, V] fp32 temporaries stay
under `_GROUP_BYTES` (the fused sampler with top-k self-conditioning has none: one group); with the
torch sampler the generator draws (multinomial, renoise) are per request, with the fused one
(`sampler`, the default on CUDA) they are one launch for the group. One host sync per step reads
which requests stopped and how many positions each accepted; the fused top-k self-conditioning adds
one that looks for rows past its candidate slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import OfficialConfig
from canvasq.decoders.sampling import (
    SamplerSettings,
    draw_fused,
    draw_torch,
    entropy_bound_keep,
    philox_key,
    self_conditioning,
)
from canvasq.decoders.state import Seq, row_generator
from canvasq.decoders.types import FinishReason

_GROUP_BYTES = 2 << 30  # per [rows, V] fp32 temporary of the sampler statistics


@dataclass
class _Denoising:
    """A request's state within its current canvas."""

    steps_left: int  # HF's cur_step: N on the first step of a canvas, 1 on the last
    argmax: torch.Tensor | None = None  # [C]: the canvas's tokens once it stops
    history: torch.Tensor | None = None  # [S, C]: the last S argmax canvases (stability test)

    def final(self) -> torch.Tensor:
        """[C]: the canvas's tokens, once a step has stopped it (its last argmax)."""
        assert self.argmax is not None
        return self.argmax


class OfficialDecoder(StepDecoder):
    name = "official"
    config_cls = OfficialConfig

    def __init__(self, bundle, config: OfficialConfig | None = None):
        super().__init__(bundle, config)
        self.sampler = SamplerSettings.resolve(self.model, self.config)
        self.V = self.rt.vocab_size
        self._dn: dict[int, _Denoising] = {}
        sampler = self.config.sampler
        if sampler == "auto":
            sampler = "fused" if self.device.type == "cuda" and self.config.seed_mode == "row" else "torch"
        self.fused = sampler == "fused"
        k = self.config.sc_topk
        # the fused draws with top-k SC hold no [rows, V] temporaries: the whole step is one group
        # (one launch, one set of host syncs; eight groups cost ~50 ms of a 64-slot step on an H200)
        self._one_group = self.fused and k is not None and k < self.V
        # a canvas's first step under top-k SC: a zero top-k signal with every row off (read-only)
        self._zero_sc = (
            None
            if k is None or k >= self.V
            else (
                (
                    torch.zeros(self.C, k, dtype=torch.long, device=self.device),
                    torch.zeros(self.C, k, dtype=self.rt.dtype, device=self.device),
                ),
                torch.zeros(self.C, dtype=torch.bool, device=self.device),
            )
        )

    # -- hooks of the base loop -------------------------------------------------------------------
    def generator(self, seed: int, custom_id: str) -> torch.Generator:
        """On the model's device: the multinomial draws need a generator where the probabilities are."""
        if self.config.seed_mode == "plain":
            state = int(seed)
        else:
            state = row_generator(seed, custom_id).initial_seed()
        g = torch.Generator(device=self.device)
        g.manual_seed(state)
        return g

    def step_budget(self, seqs: list[Seq]) -> int:
        """Each canvas ends after at most N steps and one encoder pass."""
        return max(s.n_canvases for s in seqs) * (self.sampler.steps + 1) + 16

    def spawn(self, s: Seq):
        """A new canvas x_T ~ U(V) from the request's generator (HF: `initialize_canvas`), its
        denoising state reset."""
        cv = super().spawn(s)
        self._dn[s.row] = _Denoising(steps_left=self.sampler.steps)
        return cv

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        enc = self.take_deferred(seqs) if self.folds else {}  # encoder rows riding in this forward
        windows = [self._window(s.slot, s.canvases[0], enc.get(s.row)) for s in seqs]
        with self.timed() as t:
            out = self.forward(windows)
        logits = out.logits.view(len(seqs), self.C, self.V)

        accepted, stopped = [], []
        group = len(seqs) if self._one_group else max(1, _GROUP_BYTES // (4 * self.C * self.V))
        for g0 in range(0, len(seqs), group):
            part = seqs[g0 : g0 + group]
            a, st = self._sample(part, logits[g0 : g0 + group])
            accepted.append(a)
            stopped.append(st)
        # the step's one host sync: how many positions each request accepted, which ones stopped
        counts = torch.cat(accepted).tolist()
        done = torch.cat(stopped).tolist()
        self.record(
            "decode",
            t.ms,
            {s.row: self.C + (enc[s.row][0].numel() if s.row in enc else 0) for s in seqs},
            {s.row: c for s, c in zip(seqs, counts)},
            {s.row: "full" for s in seqs},
        )
        finished = [s for s, d in zip(seqs, done) if d]
        if finished:
            self._finish_canvases(finished)

    def _window(self, slot: int, cv, enc: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The canvas's decoder window. A canvas's first step has no self-conditioning; with top-k SC it
        still carries a zero top-k signal (`self_cond_rows` all off, exactly HF's "no logits"), so
        every window of a forward has the same kind and graphed forwards share one capture. `enc`
        (ids, positions): an encoder pass of the slot's (`fold_encode`) in front, as causal rows
        with no self-conditioning."""
        from canvasq.model.runtime import Window

        if cv.sc is None and self._zero_sc is not None:
            sc, rows = self._zero_sc
        else:
            sc, rows = cv.sc, None
        if enc is None:
            return Window.canvas(slot, cv.tokens, cv.start, self_cond=sc, self_cond_rows=rows)
        ids, pos = enc
        n, dev = ids.numel(), self.device
        if sc is not None:
            on = torch.ones(self.C, dtype=torch.bool, device=dev) if rows is None else rows
            rows = torch.cat([torch.zeros(n, dtype=torch.bool, device=dev), on])

            def behind(t: torch.Tensor) -> torch.Tensor:  # no signal for the encoder rows in front
                return torch.cat([t.new_zeros((n, *t.shape[1:])), t])

            sc = (behind(sc[0]), behind(sc[1])) if isinstance(sc, tuple) else behind(sc)
        canvas = torch.arange(cv.start, cv.start + self.C, device=dev)
        return Window(
            slot,
            torch.cat([ids, cv.tokens]),
            torch.cat([pos, canvas]),
            torch.cat([pos, torch.full_like(canvas, cv.start)]),
            torch.cat([pos + 1, torch.full_like(canvas, cv.start + self.C)]),
            self_cond=sc,
            self_cond_rows=rows,
            encoder_rows=n,
        )

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler on one group: logits [B, C, V] fp32 -> (accepted per request [B], stopped [B])."""
        smp = self.sampler
        dns = [self._dn[s.row] for s in seqs]
        temp = None
        if smp.t_min is not None:
            # HF's LinearTemperatureScheduleLogitsProcessor, same dtype path (int32 step / N in fp32)
            n = torch.tensor([d.steps_left for d in dns], dtype=torch.int32, device=logits.device)
            assert smp.t_max is not None  # set with t_min (`SamplerSettings.resolve`)
            temp = smp.t_min + (smp.t_max - smp.t_min) * (n / smp.steps)
        top = None
        if self.fused:  # the kernel scales as it reads
            seeds = torch.tensor(
                [philox_key(s.gen.initial_seed(), s.spawned, d.steps_left) for s, d in zip(seqs, dns)],
                dtype=torch.long,
            ).to(self.device, non_blocking=True)
            argmax, entropy, pick, top = draw_fused(
                logits, seeds, None if temp is None else 1.0 / temp, self.config.sc_topk, self.rt.dtype
            )
        else:
            if temp is not None:
                logits = logits.div_(temp[:, None, None])  # the forward's own copy: in place
            argmax, entropy, pick = draw_torch(logits, [s.gen for s in seqs])
        keep = entropy_bound_keep(entropy, smp.entropy_bound)
        for s, tokens in zip(seqs, pick(keep)):
            cv = s.canvases[0]
            cv.tokens = tokens
            cv.age += 1
        stopped = self._stopped(seqs, dns, argmax, entropy)
        sc = top if top is not None else self_conditioning(logits, self.config.sc_topk, self.rt.dtype)
        for b, (s, d) in enumerate(zip(seqs, dns)):
            d.argmax = argmax[b]
            d.steps_left -= 1
            s.canvases[0].sc = sc[b] if not isinstance(sc, tuple) else (sc[0][b], sc[1][b])
        return keep.sum(dim=-1), stopped

    def _stopped(
        self, seqs: list[Seq], dns: list[_Denoising], argmax: torch.Tensor, entropy: torch.Tensor
    ) -> torch.Tensor:
        """Which canvases end this step [B]: HF's StableAndConfidentStoppingCriteria (the argmax
        unchanged for `stability_threshold` steps and the mean entropy under `confidence_threshold`),
        or the step cap."""
        smp = self.sampler
        stopped = torch.zeros(len(seqs), dtype=torch.bool, device=argmax.device)
        if smp.stability_threshold is not None:
            S, confidence = smp.stability_threshold, smp.confidence_threshold
            assert confidence is not None  # set with stability_threshold (`SamplerSettings.resolve`)
            if S == 0:
                stable = torch.ones_like(stopped)
            else:
                hist = torch.stack(
                    [
                        d.history
                        if d.history is not None
                        else torch.full((S, self.C), -1, dtype=argmax.dtype, device=argmax.device)
                        for d in dns
                    ]
                )  # [B, S, C]
                stable = (hist == argmax[:, None, :]).all(dim=-1).all(dim=-1)
                hist = torch.cat([hist[:, 1:], argmax[:, None, :]], dim=1)
                for b, d in enumerate(dns):
                    d.history = hist[b]
            stopped = stable & (entropy.mean(dim=-1) < confidence)
        last = torch.tensor([d.steps_left <= 1 for d in dns], device=argmax.device)
        return stopped | last

    # -- a canvas ends ----------------------------------------------------------------------------
    def _answer_ends(self, s: Seq, toks: list[int]) -> str | None:
        """Whether the answer ends with the canvas just finished (`toks`): its finish reason, or None.
        EOS (or PAD) in it ends it; so do its last canvas and max_tokens."""
        if any(t in self.stop_ids for t in toks):
            return FinishReason.stop
        if s.spawned >= s.n_canvases or len(s.out) >= s.req.max_tokens:
            return FinishReason.length
        return None

    def _finish_canvases(self, seqs: list[Seq]) -> None:
        """Append each finished canvas's argmax; end the answer at EOS / PAD or max_tokens, else write
        the canvas to the cache (one encoder pass for all of them, with the next prompts unless
        `defer_commits` is off) and start the next one."""
        tokens = torch.stack([self._dn[s.row].final() for s in seqs]).tolist()
        encodes = []
        for s, toks in zip(seqs, tokens):
            s.out.extend(toks)
        self.note_emitted(seqs)  # the canvas is final at its last decoder step, before its encoder pass
        for s, toks in zip(seqs, tokens):
            cv = s.canvases[0]
            cv.tokens = torch.tensor(toks, dtype=torch.long, device=self.device)
            cv.committed[:] = True
            s.retired.append(cv)
            s.canvases = []
            ended = self._answer_ends(s, toks)
            if ended is not None:
                s.done, s.finish_reason = True, ended
                self._dn.pop(s.row, None)
                continue
            encodes.append((s, (s.slot, cv.tokens, torch.arange(cv.start, cv.end, device=self.device))))
        if encodes and (self.config.defer_commits or self.folds):  # before the row's next step
            for s, item in encodes:
                self.defer_encode(s, item)
        elif encodes:
            with self.timed() as t:
                self.encode([item for _, item in encodes])
            self.record(
                "encode",
                t.ms,
                {s.row: self.C for s, _ in encodes},
                {},
                {s.row: "commit" for s, _ in encodes},
            )
        for s, _ in encodes:  # the next canvas's x_T draw (no model pass: its predecessor's need not be done)
            self.spawn(s)
