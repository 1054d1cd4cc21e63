"""`funnel`: the pipe's state machine with a shrinking window.

What changes against the pipe:

- **committed rows leave the window**: a forward carries only a canvas's open rows plus the rows
  committed on the previous step (`pending`);
- **promote one step late**: a newly committed row rides one more forward with its final token id
  as input; that forward captures its K/V, which is then promoted into the arena (capturing at
  decision time would cache the K/V of the draft token that was in the input);
- **scattered KV promotion**: `promote="arena"`: the window's K/V were written in place into the
  preallocated `KVArena` scratch after the committed entries; promotion left-compacts the kept rows
  and advances the length (`promote_window`, no copies out). `promote="simple"`: the rows' K/V are
  captured and concatenated onto every layer's tensors (`GrowingKV`, no preallocation).
  Entries carry absolute positions, so sliding layers band-mask by position and up to 5 canvases
  fit even when prompt + canvases exceed the sliding window;
- **free front retire**: a finished front canvas is already in the arena; popping it costs no
  forward (`retire_refresh=True` re-encodes it instead, for pipe parity);
- **τ_decay**: after `decay_after` forwards a canvas's τ_conf drops by `decay_rate` per forward,
  down to `decay_floor`;
- **early spawn**: when the sequence's next window would hold ≤ `early_spawn_rows` rows (given for a
  256-token canvas, scaled to the model's), the next canvas starts at once (fixed per-forward costs ride on fresh work);
- **commit-agree**: a confident argmax commits only if it equals the previous step's draft (the
  input token under argmax renoising);
- **top-k self-conditioning** (`sc_topk`, default 64);
- **prefix attention** is the runtime's (`rt.prefix_attention`: mask-free SDPA when a forward's
  mask is all-visible); `prefix_attention=False` turns it off for this decoder's forwards.

`shrink=False` keeps every row of every live canvas in the window and retires by encoder pass:
the pipe, on the same schedule (tested to give the pipe's tokens).
"""

from __future__ import annotations

import torch

from canvasq.decoders.canvases import CanvasOut
from canvasq.decoders.configs import FunnelConfig, canvas_rows
from canvasq.decoders.pipe import PipeDecoder
from canvasq.decoders.state import Canvas, Seq


def _pending(cv: Canvas) -> torch.Tensor:
    """A funnel canvas's rows committed and riding once more, promoted after (`FunnelDecoder.spawn`
    gives every canvas one)."""
    assert cv.pending is not None
    return cv.pending


def growing_kv_class():
    """`KVArena` with `promote="simple"` semantics: no preallocation; every write that needs room
    concatenates onto each layer's K/V tensors (the simple promote the arena replaces)."""
    from canvasq.model.arena import KVArena

    class GrowingKV(KVArena):
        def _check_room(self, slot: int, n: int) -> None:
            need = self.length[slot] + n
            if need > self.capacity:
                extra = need - self.capacity
                self.k = [
                    torch.cat([k, k.new_zeros(k.shape[0], k.shape[1], extra, k.shape[3])], 2) for k in self.k
                ]
                self.v = [
                    torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], extra, v.shape[3])], 2) for v in self.v
                ]
                self.pos = torch.cat([self.pos, self.pos.new_zeros(self.pos.shape[0], extra)], 1)
                self.capacity = need

    return GrowingKV


class FunnelDecoder(PipeDecoder):
    name = "funnel"
    config_cls = FunnelConfig

    def __init__(self, bundle, config=None) -> None:
        super().__init__(bundle, config)
        # Promote-one-step-late is the correctness rule; False exists only so a test can show what
        # capturing at decision time breaks.
        self.promote_late = True
        self._promote_rows: list[int] = []

    # -- storage --------------------------------------------------------------------------------
    def new_arena(self, slots: int, capacity: int):
        if self.config.promote == "arena":
            return super().new_arena(slots, capacity)
        return growing_kv_class()(
            self.rt.layer_shapes, slots, capacity, device=self.device, dtype=self.rt.dtype
        )

    def spawn(self, s: Seq) -> Canvas:
        cv = super().spawn(s)
        cv.pending = torch.zeros(cv.length, dtype=torch.bool, device=self.device)
        return cv

    # -- the shrinking window -------------------------------------------------------------------
    def window_rows(self, cv: Canvas) -> torch.Tensor:
        if not self.config.shrink:
            return super().window_rows(cv)
        return torch.nonzero(~cv.committed | _pending(cv)).flatten()

    def capture_rows(self, cv: Canvas, idx: torch.Tensor) -> torch.Tensor | None:
        if not self.config.shrink or self.config.promote == "arena":
            return None  # the arena promotes straight from the window's scratch rows
        if self.promote_late:
            return _pending(cv)[idx].clone()  # rows riding with their final id
        return ~cv.committed[idx]  # decision time: capture every open row, keep the ones that commit

    def after_forward(self, s: Seq, co: CanvasOut, newly: torch.Tensor) -> None:
        if not self.config.shrink:
            return
        cv, idx = co.part.cv, co.part.idx
        # rows whose K/V join the cache now: the ones that rode with their final id (promote one
        # step late), or — decision-time mode, the bug the rule prevents — the ones just committed
        pending = _pending(cv)
        done_now = pending[idx].clone() if self.promote_late else newly
        if self.config.promote == "arena":
            self._promote_rows.extend((co.part.off + torch.nonzero(done_now).flatten()).tolist())
        elif co.captured is not None and bool(done_now.any()):
            cap, off, mask = co.captured  # GrowingKV: concatenate the captured rows
            rank = torch.cumsum(mask.long(), 0) - 1
            assert self.arena is not None  # the stream's
            self.arena.promote(s.slot, cap, rows=(rank[done_now] + off).tolist())
        s.stats["promoted"] += int(done_now.sum())
        pending[idx[done_now]] = False
        if self.promote_late:
            pending[idx[newly]] = True

    def after_window(self, s: Seq) -> None:
        if self._promote_rows:  # one left-compaction per window, rows ascending
            assert self.arena is not None  # the stream's
            self.arena.promote_window(s.slot, sorted(self._promote_rows))
            self._promote_rows = []

    # -- retire -----------------------------------------------------------------------------------
    def can_retire(self, cv: Canvas) -> bool:
        return (not self.config.shrink) or not bool(_pending(cv).any())

    def retire(self, s: Seq, cv: Canvas, continues: bool):
        if not self.config.shrink:
            return super().retire(s, cv, continues)
        if self.config.retire_refresh and continues:
            assert self.arena is not None  # the stream's
            pos = self.arena.positions(s.slot)
            self.arena.compact(s.slot, ~((pos >= cv.start) & (pos < cv.end)))
            s.stats["refresh_retires"] += 1
            return super().retire(s, cv, continues)
        s.stats["free_retires"] += 1
        return None

    # -- schedule extras -------------------------------------------------------------------------
    def commit_threshold(self, cv: Canvas) -> float:
        cfg = self.config
        if not cfg.tau_decay or cv.age <= cfg.decay_after:
            return cfg.tau_conf
        return max(cfg.decay_floor, cfg.tau_conf - cfg.decay_rate * (cv.age - cfg.decay_after))

    def requires_agreement(self) -> bool:
        return self.config.agree

    def early_spawn(self, s: Seq) -> bool:
        cfg = self.config
        if not cfg.early_spawn:
            return False
        rows = sum(int(self.window_rows(cv).numel()) for cv in s.canvases)
        return rows <= canvas_rows(cfg.early_spawn_rows, self.C)

    def decode_call(self, windows):
        """Prefix attention is the runtime's (mask-free SDPA where the mask is all-visible), chosen
        per forward: the runtime is shared."""
        return self.forward(windows, prefix_attention=self.config.prefix_attention)
