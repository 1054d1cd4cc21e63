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

Only batching differs from `generate()`: a request that stops leaves the forward (HF computes and
discards it), requests advance through their canvases independently, and each draws from its own
generator (`seed_mode="row"`: output independent of the batch). With `seed_mode="plain"` and
`sc_topk=None` a batch of one draws what `torch.manual_seed(seed); model.generate(...)` draws (the
parity test). `sc_topk=k` self-conditions on the previous logits' top k (runtime's projection).

The strategy over the shared loop (`base.StepDecoder`): it spawns canvases, gives each window its
inputs, commits from the logits (`sampling`'s pieces) and decides when a canvas stops. Per-request
state is tensors indexed by arena slot (`sampling.SlotState`). The sampler runs over the live requests
in groups whose [rows, V] fp32 temporaries stay under `_GROUP_BYTES` (one group for the fused sampler
with top-k self-conditioning, the default on CUDA); one host sync per step reads which requests
stopped and how many positions each accepted.
"""

from __future__ import annotations

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import OfficialConfig, canvas_rows
from canvasq.decoders.constrained import CanvasConstraints
from canvasq.decoders.sampling import (
    SamplerSettings,
    SlotState,
    draw_fused,
    draw_torch,
    entropy_bound_keep,
    philox_keys,
    self_conditioning,
    temperatures,
    zero_top_k_sc,
)
from canvasq.decoders.state import Canvas, Seq, row_generator
from canvasq.decoders.windows import front_windows

_GROUP_BYTES = 2 << 30  # per [rows, V] fp32 temporary of the sampler statistics


class OfficialDecoder(StepDecoder):
    name = "official"
    config_cls = OfficialConfig

    def __init__(self, bundle, config: OfficialConfig | None = None):
        super().__init__(bundle, config)
        self.sampler = SamplerSettings.resolve(self.model, self.config)
        self.V = self.rt.vocab_size
        auto = self.device.type == "cuda" and self.config.seed_mode == "row"  # "auto": fused where it can
        self.fused = self.config.sampler == "fused" or (self.config.sampler == "auto" and auto)
        k = self.config.sc_topk
        self._k = k if k is not None and k < self.V else None
        # the fused draws with top-k SC hold no [rows, V] temporaries: the whole step is one group
        # (one launch, one set of host syncs; eight groups cost ~50 ms of a 64-slot step on an H200)
        self._one_group = self.fused and self._k is not None
        self._zero_sc = zero_top_k_sc(self.C, self._k, self.rt.dtype, self.device)
        self._slots: SlotState | None = None
        self._spawned: list[tuple[Seq, Canvas]] = []  # canvases whose slot state is reset next step
        # the rows with a response_format (decoders/constrained.py)
        cfg = self.config
        cap = cfg.constraint_max_steps
        settle = (cfg.constraint_settle, cfg.constraint_settle_positions, cap and canvas_rows(cap, self.C))
        self.constraints = CanvasConstraints(
            bundle, self.C, self.V, self.device, *settle, open_hold=cfg.constraint_open_hold
        )

    # -- hooks of the base loop -------------------------------------------------------------------
    def generator(self, seed: int, custom_id: str) -> torch.Generator:
        """On the model's device: the multinomial draws need a generator where the probabilities are."""
        plain = self.config.seed_mode == "plain"
        state = int(seed) if plain else row_generator(seed, custom_id).initial_seed()
        return torch.Generator(device=self.device).manual_seed(state)

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
        self.constraints.account(s)  # the masks' host time, kept per slot, into the row's stats
        return self.constraints.checked(s, super()._result(s))

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        fresh = self._begin()
        enc = self.take_deferred(seqs) if self.folds else {}  # encoder rows riding in this forward
        windows = front_windows(seqs, self._zero_sc, self.device, enc)
        with self.timed() as t:
            out = self.forward(windows)
        idx, B, R = self.slot_index(seqs), len(seqs), self.C
        # with a deferred head, logits are read by row group: no [B·C, V] buffer for the step
        budget = self.rt.defer_head_bytes if out.deferred else _GROUP_BYTES
        group = B if not out.deferred and self._one_group else max(1, budget // (4 * R * self.V))
        # masked logits must be capped first (the cap would lift NEG to -cap)
        uncapped = out.deferred and self._one_group and self.config.cap_on_read and not self.constraints.rows
        parts = []
        for g in range(0, B, group):
            rows_g = self._rows(out, g, min(B, g + group), uncapped)
            # masked in place before the sampler reads; canvases pinned whole stop whatever its rule says
            ended = self.constraints.mask(seqs[g : g + group], rows_g[0])
            parts.append(self._sample(seqs[g : g + group], idx[g : g + group], *rows_g))
            if ended is not None:
                parts[-1][1] |= ended
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
            # constrained rows: their best valid paths (read with the argmax: one sync)
            tokens = self.constraints.final(finished, self.slots.argmax[self.slot_index(finished)])
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

    def _rows(self, out, start: int, stop: int, uncapped: bool) -> tuple[torch.Tensor, float | None]:
        """Windows start:stop's logits [b, C, V] and the soft cap the sampler still applies to them: the
        head's output before the cap when `uncapped` and the forward deferred it, else capped fp32."""
        a, b = start * self.C, stop * self.C
        raw = out.rows_uncapped(a, b) if uncapped else None
        cap = out.softcap if raw is not None else None
        return (out.rows_logits(a, b) if raw is None else raw).view(-1, self.C, self.V), cap

    def _sample(self, seqs: list[Seq], idx: torch.Tensor, logits: torch.Tensor, cap: float | None = None):
        """The sampler on one group (slots `idx`): logits [B, C, V] (fp32, or before the soft cap `cap`:
        fused only) -> [2, B] (accepted, stopped); the slots' inputs, SC, argmax, steps left written."""
        smp, st = self.sampler, self.slots
        left = st.left[idx]
        temp, top = temperatures(left, smp), None
        if self.fused:  # the kernel scales as it reads
            keys = philox_keys(st.seed[idx], st.canvas[idx], left.long())
            inv = None if temp is None else 1.0 / temp
            sc_k, dtype, rule = self.config.sc_topk, self.rt.dtype, self.config.draw
            argmax, entropy, pick, top = draw_fused(logits, keys, inv, sc_k, dtype, cap, rule)
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
        """Which canvases end this step (`SlotState.stopped`; benchmarks/replay.py overrides it)."""
        return self.slots.stopped(idx, argmax, entropy, self.sampler)
