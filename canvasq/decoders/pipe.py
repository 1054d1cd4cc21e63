"""`pipe`: the D2F pipeline ("multi-canvas D2F scheduling").

Up to K canvases of one answer are in flight. Between canvases attention is block-causal: a canvas
sees the prompt and finished canvases through the arena, the earlier live canvases and itself
through the window, never a later canvas. Each canvas has a state:

    full   the front canvas (always forced to full) — or a later one whose predecessor reached τ_act
    semi   a later canvas whose predecessor reached τ_add: commits confident tokens
    draft  spawned early (draft spawn, at τ_add − 0.15): renoised and self-conditioned, never commits

With draft-only pipelining (`draft_only`, the default) no canvas behind the front graduates: later
canvases stay drafts until they become the front, so nothing is committed against a half-settled
predecessor (the seed's semi commits cost 10-20 points on the testbed's 32-token canvases).

One step = one decoder forward over every live sequence's window (all rows of all live canvases),
then per canvas: commit (τ_conf; τ_eos EOS priority, optional EOS streak; forced accept on the
front), argmax renoise of the rest (or mix mode; Jacobi random restart after 8 steps of ≤ 1
commit), self-conditioning for the next step, then retire (a finished front canvas is written to
the cache by an encoder pass — one more forward — unless the answer ends there), then spawn.

Committed tokens never change (D2F commits are final). With `front="revise"` the front commits
nothing until it is accepted whole, the native sampler's way (decoders/front.py). The answer ends at
the first committed EOS whose prefix is committed, or when the committed prefix covers max_tokens.

This module is the strategy: which rows commit (`_commits`), renoise and restart (`_update_canvas`,
`Canvas.livelocked`) and the hooks the funnel overrides. The canvas pipeline's mechanics — the
block-causal window, self-conditioning per canvas, renoising, the entropy cap, retiring, spawning
and graduating canvases, the retire pass — are `canvases`'.
"""

from __future__ import annotations

import torch

from canvasq.decoders import canvases
from canvasq.decoders.base import StepDecoder
from canvasq.decoders.canvases import CanvasOut, Part
from canvasq.decoders.configs import PipeConfig, canvas_rows
from canvasq.decoders.front import accept, extra_steps, revising
from canvasq.decoders.state import Canvas, Seq


class PipeDecoder(StepDecoder):
    name = "pipe"
    config_cls = PipeConfig

    def __init__(self, bundle, config=None) -> None:
        super().__init__(bundle, config)
        cfg = self.config
        self.sc = canvases.SelfCond(
            cfg.self_conditioning, cfg.sc_topk, self.rt.vocab_size, self.rt.dtype, self.device
        )

    # -- hooks the funnel overrides ---------------------------------------------------------------
    def window_rows(self, cv: Canvas) -> torch.Tensor:
        """Canvas positions that ride this forward: the pipe recomputes the full canvas."""
        return torch.arange(cv.length, device=self.device)

    def capture_rows(self, cv: Canvas, idx: torch.Tensor) -> torch.Tensor | None:
        return None

    def after_forward(self, s: Seq, co: CanvasOut, newly: torch.Tensor) -> None:
        """Called per canvas after its commits (funnel: promotion)."""

    def after_window(self, s: Seq) -> None:
        """Called once per sequence after all its canvases were updated."""

    def decode_call(self, windows):
        return self.forward(windows)

    def emitted(self, s: Seq) -> int:
        """Retired canvases plus the front canvas's committed prefix (D2F commits are final)."""
        return len(s.out) + (canvases.front_prefix(s.canvases[0]) if s.canvases else 0)

    def commit_threshold(self, cv: Canvas) -> float:
        return self.config.tau_conf

    def requires_agreement(self) -> bool:
        return False

    def can_retire(self, cv: Canvas) -> bool:
        return True

    def retire(self, s: Seq, cv: Canvas, continues: bool) -> tuple | None:
        """What retiring a finished front canvas costs: an encoder pass writing it to the cache
        (returned as an encode item), skipped when the answer ends with it."""
        if not continues:
            return None
        pos = torch.arange(cv.start, cv.end, device=self.device)
        return (s.slot, cv.tokens.clone(), pos)

    def early_spawn(self, s: Seq) -> bool:
        return False

    def step_budget(self, seqs: list[Seq]) -> int:
        return super().step_budget(seqs) + extra_steps(self, seqs)

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        """One forward over every sequence's live canvases, each canvas updated from its logits, then
        the turnover (retire, spawn, graduate) and one encoder pass for what retired."""
        riding = []  # (sequence, its window's parts); a sequence whose canvases all wait to retire sits out
        for s in seqs:
            parts = canvases.layout(s.canvases, self.window_rows, self.capture_rows)
            if parts:
                riding.append((s, parts))
        if riding:
            windows = [canvases.block_window(s.slot, parts, self.sc) for s, parts in riding]
            states = {s.row: ",".join(cv.state for cv in s.canvases) for s, _ in riding}
            with self.timed() as t:
                out = self.decode_call(windows)
            commits = {s.row: self._apply(s, parts, out, b) for b, (s, parts) in enumerate(riding)}
            self.record(
                "decode", t.ms, {s.row: w.rows for (s, _), w in zip(riding, windows)}, commits, states
            )
            self.note_emitted([s for s, _ in riding])  # before the retire pass: the front's prefix is final
        canvases.encode_pass(self, [(s, canvases.turnover(self, s)) for s in seqs])

    def _apply(self, s: Seq, parts: list[Part], out, b: int) -> int:
        """Update each canvas of window `b` and store its self-conditioning; returns the tokens it
        committed."""
        n_new = 0
        for co in canvases.split(parts, out, b):
            newly = self._update_canvas(s, co)
            self.after_forward(s, co, newly)
            n_new += int(newly.sum())
        self.sc.store(parts, out.window_logits(b))
        self.after_window(s)
        return n_new

    # -- commit rules ---------------------------------------------------------------------------
    def _update_canvas(self, s: Seq, co: CanvasOut) -> torch.Tensor:
        """Commit (drafts never do), then renoise what stays open; returns the newly committed mask
        over the canvas's riding rows."""
        cfg, cv, idx = self.config, co.part.cv, co.part.idx
        cv.age += 1
        open_ = ~cv.committed[idx]
        if cv.pending is not None:
            open_ &= ~cv.pending[idx]
        front = revising(self, s, cv)  # front="revise": decoders/front.py
        if front:
            newly = accept(self, s, co, open_)
        else:
            newly = self._commits(s, co, open_) if cv.state != "draft" else torch.zeros_like(open_)
        if cfg.tau_eos is not None and cfg.eos_streak:  # this step's argmax-EOS, for the next step
            if cv.prev_eos is None:
                cv.prev_eos = torch.zeros(cv.length, dtype=torch.bool, device=self.device)
            cv.prev_eos[idx] = co.arg == self.eos_id
        cv.committed[idx[newly]] = True
        cv.tokens[idx[newly]] = co.arg[newly]
        n_new = int(newly.sum())
        s.stats["commits"] += n_new
        # Jacobi livelock (≤ 1 commit for 8 consecutive committing steps): one random restart
        restart = not front and cv.livelocked(n_new, cfg.jacobi_window, cfg.jacobi_max_commits)
        if restart:
            s.stats["jacobi_restarts"] += 1
        still = open_ & ~newly
        mix = cfg.mix_fraction if cfg.renoise == "mix" else None
        if not (front and cfg.front == "native"):  # a native front drew its own next input
            canvases.renoise(cv, idx[still], co.arg[still], s.gen, self.rt.vocab_size, mix, restart)
        return newly

    def _commits(self, s: Seq, co: CanvasOut, open_: torch.Tensor) -> torch.Tensor:
        """The open rows that commit: p(argmax) ≥ the canvas's threshold (left-first within
        `commit_window`), agreeing with the draft where required, entropy-capped; EOS priority (τ_eos,
        optionally a streak of two); forced accept of the most confident row on a stalled front."""
        cfg, cv, idx = self.config, co.part.cv, co.part.idx
        eligible = open_  # left-first (commit_window): only the first W open positions, in order
        if cfg.commit_window is not None:
            eligible = open_ & (torch.cumsum(open_.long(), 0) <= canvas_rows(cfg.commit_window, cv.length))
        newly = eligible & (co.conf >= self.commit_threshold(cv))
        if self.requires_agreement():
            agreed = newly & (co.arg == cv.tokens[idx])
            s.stats["agree_blocked"] += int((newly & ~agreed).sum())
            newly = agreed
        if cfg.entropy_budget is not None and bool(newly.any()):
            newly, dropped = canvases.entropy_cap(newly, co.probs, cfg.entropy_budget)
            s.stats["entropy_capped"] += dropped
        if cfg.tau_eos is not None:
            eos_ok = open_ & (co.arg == self.eos_id) & (co.conf >= cfg.tau_eos)
            if cfg.eos_streak:
                eos_ok &= cv.prev_eos[idx] if cv.prev_eos is not None else torch.zeros_like(eos_ok)
            s.stats["eos_priority"] += int((eos_ok & ~newly).sum())
            newly |= eos_ok
        front = bool(s.canvases) and s.canvases[0] is cv and cv.state == "full"
        if front and cfg.forced_accept and not bool(newly.any()) and bool(open_.any()):
            # forced accept: the front never stalls; commit its most confident open position
            newly[torch.where(eligible, co.conf, torch.full_like(co.conf, -1.0)).argmax()] = True
            s.stats["forced_accepts"] += 1
        return newly
