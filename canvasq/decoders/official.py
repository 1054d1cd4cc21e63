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

The strategy over the shared loop (`base.StepDecoder`: encoder rows folded in front of a window, a
stopped canvas's retirement, the answer-end rule, the commit's encoder pass): it spawns canvases,
gives each window its inputs, commits from the logits (`sampling`'s pieces) and decides when a
canvas stops. Its per-request state is tensors indexed by arena slot (`sampling.SlotState`),
gathered and scattered with the live rows' slot index. The sampler runs over the live requests in
groups whose [rows, V] fp32 temporaries stay under `_GROUP_BYTES` (the fused sampler with top-k
self-conditioning has none: one group); with the torch sampler the generator draws (multinomial,
renoise) are per request, with the fused one (`sampler`, the default on CUDA) one launch for the
group. One host sync per step reads which requests stopped and how many positions each accepted
(and, when canvases end, their tokens); the fused top-k self-conditioning adds one that looks for
rows past its candidate slots.
"""

from __future__ import annotations

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import OfficialConfig
from canvasq.decoders.constrained import CanvasConstraints
from canvasq.decoders.sampling import (
    SamplerSettings,
    SlotState,
    draw_fused,
    draw_torch,
    entropy_bound_keep,
    philox_keys,
    self_conditioning,
    stable_and_confident,
    temperatures,
)
from canvasq.decoders.state import Canvas, Seq, row_generator
from canvasq.decoders.windows import canvas_window

_GROUP_BYTES = 2 << 30  # per [rows, V] fp32 temporary of the sampler statistics


class OfficialDecoder(StepDecoder):
    name = "official"
    config_cls = OfficialConfig

    def __init__(self, bundle, config: OfficialConfig | None = None):
        super().__init__(bundle, config)
        self.sampler = SamplerSettings.resolve(self.model, self.config)
        self.V = self.rt.vocab_size
        sampler = self.config.sampler
        if sampler == "auto":
            sampler = "fused" if self.device.type == "cuda" and self.config.seed_mode == "row" else "torch"
        self.fused = sampler == "fused"
        k = self.config.sc_topk
        self._k = k if k is not None and k < self.V else None
        # the fused draws with top-k SC hold no [rows, V] temporaries: the whole step is one group
        # (one launch, one set of host syncs; eight groups cost ~50 ms of a 64-slot step on an H200)
        self._one_group = self.fused and self._k is not None
        # a canvas's first step under top-k SC: a zero top-k signal with every row off (read-only)
        self._zero_sc = None
        if self._k is not None:
            ids = torch.zeros(self.C, self._k, dtype=torch.long, device=self.device)
            off = torch.zeros(self.C, dtype=torch.bool, device=self.device)
            self._zero_sc = ((ids, ids.to(self.rt.dtype)), off)
        self._slots: SlotState | None = None
        self._spawned: list[tuple[Seq, Canvas]] = []  # canvases whose slot state is reset next step
        # the rows with a response_format (decoders/constrained.py)
        self.constraints = CanvasConstraints(
            bundle, self.C, self.V, self.device, self.config.constraint_settle
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

    @property
    def slots(self) -> SlotState:
        assert self._slots is not None, "no stream"  # set by `new_stream`
        return self._slots

    def new_stream(self, slots: int) -> None:
        S = self.sampler.stability_threshold or 0
        self._slots = SlotState(slots, self.C, S, self._k, self.V, self.rt.dtype, self.device)
        self._spawned = []
        self.constraints.reset()

    def release_stream(self) -> None:
        super().release_stream()
        self._slots, self._spawned = None, []

    def spawn(self, s: Seq) -> Canvas:
        """A new canvas x_T ~ U(V) from the request's generator (HF: `initialize_canvas`); its slot's
        denoising state is reset at the next step (`_begin`)."""
        cv = super().spawn(s)
        self._spawned.append((s, cv))
        self.constraints.begin(s, cv)
        return cv

    def _result(self, s: Seq):
        return self.constraints.checked(s, super()._result(s))

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        fresh = self._begin()
        enc = self.take_deferred(seqs) if self.folds else {}  # encoder rows riding in this forward
        windows = [self._window(s.slot, s.canvases[0], enc.get(s.row)) for s in seqs]
        with self.timed() as t:
            out = self.forward(windows)
        idx, B, R = self.slot_index(seqs), len(seqs), self.C
        logits = None  # with a deferred head, read by row group: no [B·C, V] buffer for the step
        if not out.deferred or self.constraints.rows:
            logits = out.logits.view(B, R, self.V)
            self.constraints.mask(seqs, logits)  # in place: the row groups below read the masked rows
        if logits is None:
            group = max(1, self.rt.defer_head_bytes // (4 * R * self.V))
        else:
            group = B if self._one_group else max(1, _GROUP_BYTES // (4 * R * self.V))
        uncapped = logits is None and self._one_group and self.config.cap_on_read
        parts = [
            self._sample(
                seqs[g : g + group], idx[g : g + group], *self._rows(out, g, min(B, g + group), uncapped)
            )
            for g in range(0, B, group)
        ]
        # the step's one host sync: how many positions each request accepted, which ones stopped
        counts, done = torch.cat(parts, dim=1).tolist()
        for s, cv in fresh:  # their first step has written the slot's self-conditioning
            cv.sc = self.slots.sc_at(s.slot)
        rows = {s.row: w.rows for s, w in zip(seqs, windows)}
        self.record(
            "decode", t.ms, rows, {s.row: c for s, c in zip(seqs, counts)}, dict.fromkeys(rows, "full")
        )
        at = [b for b, d in enumerate(done) if d]
        if at:  # the canvases' tokens: their last argmax (a constrained row's: its best valid path)
            finished = [seqs[b] for b in at]
            tokens = self.slots.argmax[self.slot_index(finished)].tolist()
            if logits is not None:  # a constrained row's canvas ends on its best valid path
                tokens = self.constraints.final(finished, logits, at, tokens)
            self.retire_canvases(finished, tokens)

    def _begin(self) -> list[tuple[Seq, Canvas]]:
        """The canvases spawned since the last step: their slots' state reset (one scatter each)."""
        fresh = {s.slot: (s, cv) for s, cv in self._spawned if not s.done}  # a slot's latest
        self._spawned = []
        rows = list(fresh.values())
        if rows:
            seeds, numbers = [s.gen.initial_seed() for s, _ in rows], [s.spawned for s, _ in rows]
            self.slots.reset(list(fresh), seeds, numbers, self.sampler.steps, [cv for _, cv in rows])
        return rows

    def _window(self, slot: int, cv: Canvas, enc: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The canvas's decoder window. A canvas's first step has no self-conditioning; with top-k SC it
        still carries a zero top-k signal (`self_cond_rows` all off, exactly HF's "no logits"), so
        every window of a forward has the same kind and graphed forwards share one capture."""
        sc, rows = (cv.sc, None) if cv.sc is not None or self._zero_sc is None else self._zero_sc
        return canvas_window(slot, cv.tokens, cv.start, sc, rows, enc)

    def _rows(self, out, start: int, stop: int, uncapped: bool) -> tuple[torch.Tensor, float | None]:
        """Windows start:stop's logits [b, C, V] and the soft cap the sampler still applies to them: the
        head's output before the cap when `uncapped` and the forward deferred it, else capped fp32."""
        R = self.C
        raw = out.rows_uncapped(start * R, stop * R) if uncapped else None
        if raw is not None:
            return raw.view(-1, R, self.V), out.softcap
        return out.rows_logits(start * R, stop * R).view(-1, R, self.V), None

    def _sample(self, seqs: list[Seq], idx: torch.Tensor, logits: torch.Tensor, cap: float | None = None):
        """The sampler on one group (slots `idx`): logits [B, C, V] (fp32; or the head's output before
        the soft cap `cap`, fused draws only) -> [2, B] (positions accepted, stopped); the slots' next
        inputs, self-conditioning, argmax and steps left written."""
        smp, st = self.sampler, self.slots
        left = st.left[idx]
        temp, top = temperatures(left, smp), None
        if self.fused:  # the kernel scales as it reads
            keys = philox_keys(st.seed[idx], st.canvas[idx], left.long())
            inv = None if temp is None else 1.0 / temp
            argmax, entropy, pick, top = draw_fused(
                logits, keys, inv, self.config.sc_topk, self.rt.dtype, cap
            )
        else:
            if temp is not None:
                logits = logits.div_(temp[:, None, None])  # the forward's own copy: in place
            argmax, entropy, pick = draw_torch(logits, [s.gen for s in seqs])
        keep = entropy_bound_keep(entropy, smp.entropy_bound)
        st.tokens[idx] = pick(keep)
        stopped = self._stopped(seqs, idx, argmax, entropy)
        st.put_sc(idx, top if top is not None else self_conditioning(logits, self._k, self.rt.dtype))
        st.argmax[idx], st.left[idx] = argmax, left - 1
        return torch.stack([keep.sum(dim=-1), stopped.long()])

    def _stopped(self, seqs: list[Seq], idx: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor):
        """Which canvases end this step [B]: HF's StableAndConfidentStoppingCriteria
        (`stable_and_confident`, on the slots' argmax history) or the step cap."""
        smp, st = self.sampler, self.slots
        capped = st.left[idx] <= 1
        if smp.stability_threshold is None:
            return capped
        assert smp.confidence_threshold is not None  # set with stability_threshold (`resolve`)
        stopped, st.history[idx] = stable_and_confident(
            st.history[idx], argmax, entropy, smp.confidence_threshold
        )
        return stopped | capped
