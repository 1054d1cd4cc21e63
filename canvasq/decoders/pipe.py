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

Committed tokens never change (D2F commits are final). The answer ends at the first committed EOS
whose prefix is committed, or when the committed prefix covers max_tokens.
"""

from __future__ import annotations

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import PipeConfig, canvas_rows
from canvasq.decoders.state import Canvas, Seq, first_stop
from canvasq.decoders.types import FinishReason


class PipeDecoder(StepDecoder):
    name = "pipe"
    config_cls = PipeConfig

    # -- hooks the funnel overrides ---------------------------------------------------------------
    def window_rows(self, cv: Canvas) -> torch.Tensor:
        """Canvas positions that ride this forward: the pipe recomputes the full canvas."""
        return torch.arange(cv.length, device=self.device)

    def capture_rows(self, cv: Canvas, idx: torch.Tensor) -> torch.Tensor | None:
        return None

    def after_forward(
        self, s: Seq, cv: Canvas, idx: torch.Tensor, captured, newly: torch.Tensor, win_off: int
    ) -> None:
        """Called per canvas after commits (funnel: promotion); `win_off` is the canvas's first row
        in the sequence's window."""

    def after_window(self, s: Seq) -> None:
        """Called once per sequence after all its canvases were updated."""

    def decode_call(self, windows):
        return self.forward(windows)

    def emitted(self, s: Seq) -> int:
        """Retired canvases plus the front canvas's committed prefix (D2F commits are final)."""
        if not s.canvases:
            return len(s.out)
        open_pos = torch.nonzero(~s.canvases[0].committed).flatten()
        return len(s.out) + (int(open_pos[0]) if open_pos.numel() else s.canvases[0].length)

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

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        windows, layout, riding = [], [], []
        for s in seqs:
            built = self._window(s)
            if built is None:  # every live canvas is waiting to retire: nothing to forward for it
                continue
            windows.append(built[0])
            layout.append(built[1])
            riding.append(s)
        states = {s.row: ",".join(cv.state for cv in s.canvases) for s in riding}
        if windows:
            with self.timed() as t:
                out = self.decode_call(windows)
            commits = {
                s.row: self._apply(s, parts, windows[b], out, b)
                for b, (s, parts) in enumerate(zip(riding, layout))
            }
            self.record("decode", t.ms, {s.row: w.rows for s, w in zip(riding, windows)}, commits, states)
            self.note_emitted(riding)  # before the retire pass: the front's committed prefix is final
        self._retire_all(seqs)

    def _window(self, s: Seq):
        """(the sequence's window: every live canvas's riding rows, block-causal; [(canvas, rows)] in
        window order), or None when no canvas has a row to forward."""
        from canvasq.model.runtime import Window

        parts, ids, pos, lo, hi, cap = [], [], [], [], [], []
        for cv in s.canvases:
            idx = self.window_rows(cv)
            if idx.numel() == 0:
                continue
            parts.append((cv, idx))
            ids.append(cv.tokens[idx])
            p = cv.start + idx
            pos.append(p)
            lo.append(torch.full_like(p, cv.start))
            hi.append(torch.full_like(p, cv.end))
            c = self.capture_rows(cv, idx)
            cap.append(c if c is not None else torch.zeros(idx.numel(), dtype=torch.bool, device=self.device))
        if not parts:
            return None
        sc, sc_rows = self._self_cond(parts)
        w = Window(
            s.slot,
            torch.cat(ids),
            torch.cat(pos),
            torch.cat(lo),
            torch.cat(hi),
            capture=torch.cat(cap) if any(bool(c.any()) for c in cap) else None,
            self_cond=sc,
            self_cond_rows=sc_rows,
        )
        return w, parts

    def _apply(self, s: Seq, parts, window, out, b: int) -> int:
        """Commit, renoise and self-condition each canvas of window `b` from its logits; returns the
        tokens it committed."""
        logits = out.window_logits(b)
        captured = out.captured[b] if out.captured else None
        off, cap_off, n_new = 0, 0, 0
        for cv, idx in parts:
            r = idx.numel()
            cap_mask = window.capture[off : off + r] if window.capture is not None else None
            n_cap = int(cap_mask.sum()) if cap_mask is not None else 0
            cv_captured = (captured, cap_off, cap_mask) if captured is not None and n_cap else None
            newly = self._update_canvas(s, cv, idx, logits[off : off + r])
            self.after_forward(s, cv, idx, cv_captured, newly, off)
            n_new += int(newly.sum())
            off += r
            cap_off += n_cap
        self.after_window(s)
        return n_new

    def _retire_all(self, seqs: list[Seq]) -> None:
        """Retire finished front canvases and spawn the next: one causal encoder pass over every
        canvas that is written to the cache this step."""
        encodes = []
        for s in seqs:
            items = self._retire_and_spawn(s)
            if items:  # several canvases retiring at once: one causal pass over all of them
                ids = torch.cat([it[1] for it in items])
                pos = torch.cat([it[2] for it in items])
                encodes.append((s, (s.slot, ids, pos)))
        if encodes:
            with self.timed() as t:
                self.encode([e[1] for e in encodes])
            self.record(
                "encode",
                t.ms,
                {s.row: int(item[1].numel()) for s, item in encodes},
                {},
                {s.row: "commit" for s, _ in encodes},
            )

    # -- commit rules ---------------------------------------------------------------------------
    def _update_canvas(self, s: Seq, cv: Canvas, idx: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Commit, renoise and self-condition one canvas; returns the newly committed mask over idx."""
        cfg = self.config
        cv.age += 1
        probs = torch.softmax(logits.float(), dim=-1)
        conf, arg = probs.max(dim=-1)
        open_ = ~cv.committed[idx]
        if cv.pending is not None:
            open_ &= ~cv.pending[idx]
        is_front = s.canvases and s.canvases[0] is cv
        newly = torch.zeros_like(open_)
        eligible = open_  # left-first (commit_window): only the first W open positions, in order
        if cfg.commit_window is not None:
            window = canvas_rows(cfg.commit_window, cv.length)
            eligible = open_ & (torch.cumsum(open_.long(), 0) <= window)
        if cv.state != "draft":
            newly = eligible & (conf >= self.commit_threshold(cv))
            if self.requires_agreement():
                agreed = newly & (arg == cv.tokens[idx])
                s.stats["agree_blocked"] += int((newly & ~agreed).sum())
                newly = agreed
            if cfg.entropy_budget is not None and bool(newly.any()):
                newly = self._entropy_cap(s, newly, probs, cfg.entropy_budget)
            if cfg.tau_eos is not None:
                eos_ok = open_ & (arg == self.eos_id) & (conf >= cfg.tau_eos)
                if cfg.eos_streak:
                    prev = cv.prev_eos[idx] if cv.prev_eos is not None else torch.zeros_like(eos_ok)
                    eos_ok &= prev
                s.stats["eos_priority"] += int((eos_ok & ~newly).sum())
                newly |= eos_ok
            if (
                is_front
                and cv.state == "full"
                and cfg.forced_accept
                and not bool(newly.any())
                and bool(open_.any())
            ):
                # forced accept: the front never stalls; commit its most confident open position
                j = torch.where(eligible, conf, torch.full_like(conf, -1.0)).argmax()
                newly[j] = True
                s.stats["forced_accepts"] += 1
        if cfg.tau_eos is not None and cfg.eos_streak:
            if cv.prev_eos is None:
                cv.prev_eos = torch.zeros(cv.length, dtype=torch.bool, device=self.device)
            cv.prev_eos[idx] = arg == self.eos_id

        pos_new = idx[newly]
        cv.committed[pos_new] = True
        cv.tokens[pos_new] = arg[newly]
        n_new = int(newly.sum())
        s.stats["commits"] += n_new

        self._renoise(s, cv, idx, open_ & ~newly, arg, restart=self._jacobi_restart(s, cv, n_new))
        if cfg.self_conditioning:
            self._store_sc(cv, idx, logits)
        return newly

    def _jacobi_restart(self, s: Seq, cv: Canvas, n_new: int) -> bool:
        """Jacobi livelock: ≤ 1 commit for 8 consecutive committing steps → one random restart."""
        cfg = self.config
        restart = False
        if cv.state != "draft":
            if n_new <= cfg.jacobi_max_commits:
                cv.streak += 1
            else:
                cv.streak = 0
            if cv.streak >= cfg.jacobi_window:
                restart, cv.streak = True, 0
                s.stats["jacobi_restarts"] += 1
        return restart

    def _renoise(
        self, s: Seq, cv: Canvas, idx: torch.Tensor, still: torch.Tensor, arg: torch.Tensor, restart: bool
    ) -> None:
        """What is still open: argmax (the record protocol), mix, or a one-shot random restart."""
        cfg = self.config
        if bool(still.any()):
            rows = idx[still]
            V = self.rt.vocab_size
            if restart:
                cv.tokens[rows] = torch.randint(0, V, (rows.numel(),), generator=s.gen).to(self.device)
            else:
                new = arg[still]
                if cfg.renoise == "mix":
                    flip = torch.rand(rows.numel(), generator=s.gen).to(self.device) < cfg.mix_fraction
                    rand = torch.randint(0, V, (rows.numel(),), generator=s.gen).to(self.device)
                    new = torch.where(flip, rand, new)
                cv.tokens[rows] = new

    @staticmethod
    def _entropy_cap(s: Seq, newly: torch.Tensor, probs: torch.Tensor, budget: float) -> torch.Tensor:
        """Keep the lowest-entropy candidates while Σ entropy − max ≤ budget (at least one)."""
        cand = torch.nonzero(newly).flatten()
        p = probs[cand]
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        ent, order = torch.sort(ent)
        keep = (torch.cumsum(ent, 0) - ent) <= budget  # ascending: ent is the running max
        capped = torch.zeros_like(newly)
        capped[cand[order[keep]]] = True
        s.stats["entropy_capped"] += int(newly.sum()) - int(keep.sum())
        return capped

    # -- self-conditioning ------------------------------------------------------------------------
    def _store_sc(self, cv: Canvas, idx: torch.Tensor, logits: torch.Tensor) -> None:
        k = self.config.sc_topk
        dt = self.rt.dtype
        if k is None:
            if cv.sc is None:
                cv.sc = (
                    torch.zeros(cv.length, logits.shape[-1], dtype=dt, device=self.device),
                    self._no_sc(cv),
                )
            buf, have = cv.sc
            buf[idx] = logits.to(dt)
            have[idx] = True
        else:
            k = min(k, logits.shape[-1])
            vals, ids = torch.topk(logits.float(), k, dim=-1)
            if cv.sc is None:
                cv.sc = (
                    (
                        torch.zeros(cv.length, k, dtype=torch.long, device=self.device),
                        torch.zeros(cv.length, k, dtype=torch.float32, device=self.device),
                    ),
                    self._no_sc(cv),
                )
            (bid, bval), have = cv.sc
            bid[idx], bval[idx] = ids, vals
            have[idx] = True

    def _no_sc(self, cv: Canvas) -> torch.Tensor:
        return torch.zeros(cv.length, dtype=torch.bool, device=self.device)

    def _self_cond(self, parts):
        """The window's SC input and the rows that get it (a canvas's first step has none)."""
        if not self.config.self_conditioning or all(cv.sc is None for cv, _ in parts):
            return None, None
        topk = self.config.sc_topk is not None
        V = self.rt.vocab_size
        vals, ids, rows = [], [], []
        for cv, idx in parts:
            if cv.sc is None:
                rows.append(torch.zeros(idx.numel(), dtype=torch.bool, device=self.device))
                if topk:
                    k = min(self.config.sc_topk, V)
                    ids.append(torch.zeros(idx.numel(), k, dtype=torch.long, device=self.device))
                    vals.append(torch.zeros(idx.numel(), k, dtype=torch.float32, device=self.device))
                else:
                    vals.append(torch.zeros(idx.numel(), V, dtype=self.rt.dtype, device=self.device))
                continue
            buf, have = cv.sc
            rows.append(have[idx])
            if topk:
                ids.append(buf[0][idx])
                vals.append(buf[1][idx])
            else:
                vals.append(buf[idx])
        sc_rows = torch.cat(rows)
        sc = (torch.cat(ids), torch.cat(vals)) if topk else torch.cat(vals)
        return sc, sc_rows

    # -- retire, finish, spawn --------------------------------------------------------------------
    def _retire_and_spawn(self, s: Seq) -> list:
        cfg = self.config
        encodes: list[tuple] = []
        while s.canvases:
            front = s.canvases[0]
            front.state = "full"
            open_pos = torch.nonzero(~front.committed).flatten()
            p = int(open_pos[0]) if open_pos.numel() else front.length
            toks = front.tokens[:p].tolist()
            room = s.req.max_tokens - len(s.out)  # answer tokens still allowed
            cut = first_stop(toks[:room], self.stop_ids)
            if cut is not None:
                s.out += toks[: cut + 1]
                s.done, s.finish_reason = True, FinishReason.stop
                return encodes
            if p >= room:
                s.out += toks[:room]
                s.done, s.finish_reason = True, FinishReason.length
                return encodes
            if p < front.length or not self.can_retire(front):
                break
            s.retired.append(s.canvases.pop(0))
            s.out += toks
            s.stats["retired"] += 1
            item = self.retire(s, front, continues=True)
            if item is not None:
                encodes.append(item)
        if not s.canvases and s.spawned >= s.n_canvases:  # nothing left to decode
            s.done = True
            return encodes

        ended = any(
            bool((cv.committed & ((cv.tokens == self.eos_id) | (cv.tokens == self.bundle.pad_id))).any())
            for cv in s.canvases
        )
        if not ended and s.spawned < s.n_canvases:
            if not s.canvases:
                self.spawn(s)
            elif len(s.canvases) < cfg.max_canvases:
                warm = s.canvases[-1].decoded >= cfg.spawn_threshold
                if warm or self.early_spawn(s):
                    s.stats["early_spawns"] += int(not warm)
                    self.spawn(s)
        self._graduate(s)
        return encodes

    def _graduate(self, s: Seq) -> None:
        """τ_add / τ_act graduation by the previous canvas's decode fraction (states never drop);
        draft-only pipelining keeps every canvas behind the front a draft."""
        cfg = self.config
        for i, cv in enumerate(s.canvases):
            if i == 0:
                cv.state = "full"
                continue
            if cfg.draft_only:
                continue
            prev = s.canvases[i - 1].decoded
            if prev >= cfg.tau_act:
                cv.state = "full"
            elif prev >= cfg.tau_add and cv.state == "draft":
                cv.state = "semi"
