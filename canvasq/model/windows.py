"""The rows one forward carries: `Window` (one sequence's rows in one forward), the causal windows of
an encoder pass, and `DecodeOutput` (what comes back). Decoders build these; `Runtime.decode` and
`graph.DecodeGraph` run them. See `runtime`'s module docstring for the visibility rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from canvasq.model.arena import Captured

SelfCond = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class Window:
    """The rows one sequence puts into a forward. All per-row tensors are [R] int64 (bool for
    `capture` / `self_cond_rows`)."""

    slot: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    canvas_start: torch.Tensor
    canvas_end: torch.Tensor
    capture: torch.Tensor | None = None  # rows whose K/V come back in DecodeOutput.captured
    self_cond: SelfCond = None  # None | logits [R, V] | (ids [R, k], logits [R, k])
    self_cond_rows: torch.Tensor | None = None  # rows that get SC (others: zero signal)
    # leading rows that are an encoder pass riding in this decoder forward (a prompt or a retired
    # canvas, causal bounds): no input norm or logits, and their K/V are committed after the forward
    encoder_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.token_ids, torch.Tensor):
            self.token_ids = torch.as_tensor(self.token_ids, dtype=torch.long)
        r = self.token_ids.numel()
        if r == 0:
            raise ValueError("a window needs at least one row")
        for name in ("positions", "canvas_start", "canvas_end"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                t = torch.as_tensor(t, dtype=torch.long, device=self.token_ids.device)
            if t.dim() == 0:
                t = t.expand(r)
            setattr(self, name, t.to(torch.long))
        for name in ("capture", "self_cond_rows"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.as_tensor(t, dtype=torch.bool, device=self.token_ids.device))

    @property
    def rows(self) -> int:
        return int(self.token_ids.numel())

    @classmethod
    def canvas(cls, slot: int, token_ids: torch.Tensor, start: int, **kw) -> Window:
        """One canvas at positions [start, start + R), bidirectional (HF's decoder call)."""
        r = token_ids.numel()
        pos = torch.arange(start, start + r, device=token_ids.device)
        return cls(slot, token_ids, pos, torch.full_like(pos, start), torch.full_like(pos, start + r), **kw)

    @classmethod
    def blocks(cls, slot: int, canvases: list[tuple[torch.Tensor, int]], **kw) -> Window:
        """Several full canvases (ids, start) of one sequence, block-causal: canvas i sees the
        context, the canvases before it and itself (D2F pipe)."""
        ids, pos, lo, hi = [], [], [], []
        for t, start in canvases:
            r = t.numel()
            p = torch.arange(start, start + r, device=t.device)
            ids.append(t)
            pos.append(p)
            lo.append(torch.full_like(p, start))
            hi.append(torch.full_like(p, start + r))
        return cls(slot, torch.cat(ids), torch.cat(pos), torch.cat(lo), torch.cat(hi), **kw)


def to_device(values: list | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host list (as int64) or CPU tensor on `device`. On a GPU the copy is queued from
    pinned memory, so it does not wait for the work already queued: a copy from pageable memory (a
    plain `torch.tensor(..., device=)` or `.to(device)`) synchronises the stream, a wait for the whole
    queued forward (copies like these put ~15 such waits in a testbed step on an H100)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def encoder_windows(items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list[Window]:
    """(slot, ids, positions) per sequence -> the causal windows of an encoder pass."""
    windows = []
    for slot, ids, pos in items:
        pos = torch.as_tensor(pos, dtype=torch.long, device=ids.device)
        windows.append(Window(slot, ids, pos, pos, pos + 1))
    return windows


@dataclass
class DecodeOutput:
    """A decoder forward's result: fp32 softcapped logits [N, V] (window i is rows
    offsets[i]:offsets[i+1]) and each window's captured K/V.

    A large eager forward defers its LM head (`Runtime.defer_head_bytes`): it keeps the final hidden
    state [N, H] and `head` turns rows of it into logits when read, so a decoder that reads them in
    row groups (`rows_logits`) never holds the whole [N, V] buffer (16 GiB at 64 x 256 rows of a
    262k vocabulary). Reading `logits` computes them all once."""

    _logits: torch.Tensor | None
    offsets: list[int]
    captured: list[Captured | None] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [N, H], final-normed: set when the head is deferred
    head: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden rows -> their logits
    # hidden rows -> the head's output before the final soft cap `softcap` (for a reader that caps as
    # it reads, `rows_uncapped`)
    uncapped: Callable[[torch.Tensor], torch.Tensor] | None = None
    softcap: float | None = None

    @property
    def deferred(self) -> bool:
        """Whether the logits are still to compute (read them in row groups to bound memory)."""
        return self._logits is None

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            assert self.hidden is not None and self.head is not None  # a deferred head has both
            self._logits, self.hidden = self.head(self.hidden), None
        return self._logits

    def rows_logits(self, start: int, stop: int) -> torch.Tensor:
        """Logits of rows start:stop, computed for those rows alone when the head is deferred."""
        if self._logits is not None:
            return self._logits[start:stop]
        assert self.hidden is not None and self.head is not None
        with torch.no_grad():  # read after `Runtime.decode`'s no_grad: never an autograd graph
            return self.head(self.hidden[start:stop])

    def rows_uncapped(self, start: int, stop: int) -> torch.Tensor | None:
        """The LM head's output of rows start:stop before its final soft cap (`softcap`), when the head
        is deferred and the model caps its logits; else None (read `rows_logits`)."""
        if self._logits is not None or self.uncapped is None or not self.softcap:
            return None
        assert self.hidden is not None
        with torch.no_grad():
            return self.uncapped(self.hidden[start:stop])

    def first(self, n: int) -> DecodeOutput:
        """The first n windows' output (a padded forward's own windows), its head still deferred if
        this one's is."""
        end, captured = self.offsets[n], self.captured[:n] if self.captured else []
        if self._logits is None:
            assert self.hidden is not None  # a deferred head has its hidden rows
            return replace(self, offsets=self.offsets[: n + 1], captured=captured, hidden=self.hidden[:end])
        return DecodeOutput(self._logits[:end], self.offsets[: n + 1], captured)

    def window_logits(self, i: int) -> torch.Tensor:
        return self.logits[self.offsets[i] : self.offsets[i + 1]]
