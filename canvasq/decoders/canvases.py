"""The canvas pipeline's mechanics: what a decoder that keeps several canvases of one answer in
flight needs, whatever rule it commits by. `pipe` and `funnel` (a pipe with a shrinking window) use
all of it; `phcd`'s future is the same block-causal layout, its top-k self-conditioning the same
store and its `promote="encode"` pass the same encoder pass, so it could use those pieces too.

- **the window** (`layout`, `block_window`, `split`): a sequence's live canvases' riding rows as one
  block-causal `Window` (a canvas sees the arena, the earlier live canvases and itself, never a later
  one), and the forward's logits cut back per canvas, softmax and argmax taken once per window;
- **self-conditioning per canvas** (`SelfCond`): each canvas keeps the logits of its last forward
  (full vocabulary or top-k) per position; the next window gathers them for its rows;
- **renoising** (`renoise`): what stays open after a step becomes the argmax, the argmax with a
  share of uniform draws (mix), or — a restart — all uniform draws;
- **entropy cap** (`entropy_cap`): of several commit candidates, the lowest-entropy ones while
  Σ entropy − max ≤ budget;
- **turnover** (`front_prefix`, `turnover`, `graduate`): where the answer ends, retiring finished
  front canvases, spawning the next canvas, graduating the canvases behind the front;
- **the retire pass** (`encode_pass`): one causal encoder pass over every row written to the cache
  this step, with its trace.

The rules stay with the decoders: which rows ride (`window_rows`), which rows commit, when a canvas
may retire (`can_retire`) and what retiring costs (`retire`), early spawns (`early_spawn`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from canvasq.decoders.state import Canvas, Seq, first_stop
from canvasq.decoders.types import FinishReason

if TYPE_CHECKING:
    from canvasq.decoders.base import StepDecoder
    from canvasq.decoders.pipe import PipeDecoder
    from canvasq.model.windows import Window


class Part(NamedTuple):
    """One canvas's rows in a window: canvas positions `idx` at window rows [off, off + len(idx));
    `capture` marks the rows whose K/V the forward hands back (funnel's `promote="simple"`)."""

    cv: Canvas
    idx: torch.Tensor
    off: int
    capture: torch.Tensor


class CanvasOut(NamedTuple):
    """A forward's output for one `Part`: its logits, softmax, top probability and argmax per row, and
    `(captured K/V of the window, first captured row of this canvas, capture mask)` or None."""

    part: Part
    logits: torch.Tensor
    probs: torch.Tensor
    conf: torch.Tensor
    arg: torch.Tensor
    captured: tuple | None


def front_prefix(cv: Canvas) -> int:
    """A canvas's committed prefix: the rows before its first open one (commits are final)."""
    open_pos = torch.nonzero(~cv.committed).flatten()
    return int(open_pos[0]) if open_pos.numel() else cv.length


def layout(canvases: list[Canvas], rows, capture) -> list[Part]:
    """The window's parts in canvas order: `rows(cv)` the positions that ride (canvases with none are
    left out), `capture(cv, idx)` the rows to capture or None."""
    parts: list[Part] = []
    off = 0
    for cv in canvases:
        idx = rows(cv)
        if idx.numel() == 0:
            continue
        c = capture(cv, idx)
        parts.append(Part(cv, idx, off, c if c is not None else torch.zeros_like(idx, dtype=torch.bool)))
        off += idx.numel()
    return parts


def block_window(slot: int, parts: list[Part], sc: SelfCond) -> Window:
    """One sequence's window over `parts`, block-causal: a row sees up to its own canvas's end (pipe
    and funnel; phcd's future blocks are the same layout)."""
    from canvasq.model.windows import Window

    pos = [p.cv.start + p.idx for p in parts]
    sc_in, sc_rows = sc.gather(parts)
    return Window(
        slot,
        torch.cat([p.cv.tokens[p.idx] for p in parts]),
        torch.cat(pos),
        torch.cat([torch.full_like(q, p.cv.start) for p, q in zip(parts, pos)]),
        torch.cat([torch.full_like(q, p.cv.end) for p, q in zip(parts, pos)]),
        capture=torch.cat([p.capture for p in parts]) if any(bool(p.capture.any()) for p in parts) else None,
        self_cond=sc_in,
        self_cond_rows=sc_rows,
    )


def split(parts: list[Part], out, b: int) -> list[CanvasOut]:
    """Window `b` of a forward's output cut back per canvas (one softmax over the whole window)."""
    logits = out.window_logits(b)
    probs = torch.softmax(logits.float(), dim=-1)
    conf, arg = probs.max(dim=-1)
    captured = out.captured[b] if out.captured else None
    res, cap_off = [], 0
    for p in parts:
        rows = slice(p.off, p.off + p.idx.numel())
        n_cap = int(p.capture.sum())
        cap = (captured, cap_off, p.capture) if captured is not None and n_cap else None
        res.append(CanvasOut(p, logits[rows], probs[rows], conf[rows], arg[rows], cap))
        cap_off += n_cap
    return res


class SelfCond:
    """Self-conditioning per canvas: `cv.sc` holds (the logits of the canvas's last forward per
    position — a [C, V] buffer, or top-k ids and values — and a [C] bool of the positions that have
    them). `store` writes a window's logits (one top-k over the whole window); `gather` builds the
    next window's SC input and the rows that get it (a canvas's first step has none). Pipe and funnel
    (top-k by default); phcd keeps the same top-k form on its global canvas."""

    def __init__(self, enabled: bool, topk: int | None, vocab: int, dtype, device) -> None:
        self.enabled, self.vocab, self.dtype, self.device = enabled, vocab, dtype, device
        self.k = min(topk, vocab) if topk is not None else None

    def _empty(self, n: int):
        if self.k is None:
            return torch.zeros(n, self.vocab, dtype=self.dtype, device=self.device)
        ids = torch.zeros(n, self.k, dtype=torch.long, device=self.device)
        return ids, torch.zeros(n, self.k, dtype=torch.float32, device=self.device)

    def store(self, parts: list[Part], logits: torch.Tensor) -> None:
        if not self.enabled:
            return
        top = torch.topk(logits.float(), self.k, dim=-1) if self.k is not None else None
        for p in parts:
            rows = slice(p.off, p.off + p.idx.numel())
            if p.cv.sc is None:
                p.cv.sc = (
                    self._empty(p.cv.length),
                    torch.zeros(p.cv.length, dtype=torch.bool, device=self.device),
                )
            buf, have = p.cv.sc
            if top is None:
                buf[p.idx] = logits[rows].to(self.dtype)
            else:
                buf[0][p.idx], buf[1][p.idx] = top.indices[rows], top.values[rows]
            have[p.idx] = True

    def gather(self, parts: list[Part]):
        """(the window's SC input, [R] bool rows that get it), or (None, None)."""
        if not self.enabled or all(p.cv.sc is None for p in parts):
            return None, None
        bufs, rows = [], []
        for p in parts:
            if p.cv.sc is None:
                bufs.append(self._empty(p.idx.numel()))
                rows.append(torch.zeros_like(p.idx, dtype=torch.bool))
            else:
                buf, have = p.cv.sc
                bufs.append(buf[p.idx] if self.k is None else (buf[0][p.idx], buf[1][p.idx]))
                rows.append(have[p.idx])
        if self.k is None:
            return torch.cat(bufs), torch.cat(rows)
        return (torch.cat([b[0] for b in bufs]), torch.cat([b[1] for b in bufs])), torch.cat(rows)


def renoise(
    cv: Canvas, rows: torch.Tensor, arg: torch.Tensor, gen, vocab: int, mix: float | None, restart: bool
) -> None:
    """Redraw a canvas's still-open `rows` (`arg`: their argmax): the argmax (the record protocol),
    with a `mix` share of uniform draws, or — `restart` — uniform draws only. Pipe and funnel; any
    decoder whose drafts ride again as their own argmax."""
    if not rows.numel():
        return
    dev = cv.tokens.device
    if restart:
        cv.tokens[rows] = torch.randint(0, vocab, (rows.numel(),), generator=gen).to(dev)
        return
    if mix is not None:
        flip = torch.rand(rows.numel(), generator=gen).to(dev) < mix
        rand = torch.randint(0, vocab, (rows.numel(),), generator=gen).to(dev)
        arg = torch.where(flip, rand, arg)
    cv.tokens[rows] = arg


def entropy_cap(newly: torch.Tensor, probs: torch.Tensor, budget: float) -> tuple[torch.Tensor, int]:
    """Of the candidates in `newly`, keep the lowest-entropy ones while Σ entropy − max ≤ budget (at
    least one); returns (the kept mask, how many were dropped). The official sampler's acceptance as a
    cap on threshold commits (pipe, funnel: `entropy_budget`)."""
    cand = torch.nonzero(newly).flatten()
    p = probs[cand]
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    ent, order = torch.sort(ent)
    keep = (torch.cumsum(ent, 0) - ent) <= budget  # ascending: ent is the running max
    capped = torch.zeros_like(newly)
    capped[cand[order[keep]]] = True
    return capped, int(newly.sum()) - int(keep.sum())


def turnover(dec: PipeDecoder, s: Seq) -> list[tuple]:
    """After a step: end the answer at the first committed stop whose prefix is committed (or at
    max_tokens), retire every finished front canvas that `dec.can_retire` (`dec.retire` says what that
    costs: encode items returned), then spawn the next canvas and graduate the live ones. Any decoder
    with pipe's hooks (`can_retire`, `retire`, `early_spawn`, `spawn`): pipe, funnel."""
    cfg = dec.config
    items: list[tuple] = []
    while s.canvases:
        front = s.canvases[0]
        front.state = "full"
        p = front_prefix(front)
        toks = front.tokens[:p].tolist()
        room = s.req.max_tokens - len(s.out)  # answer tokens still allowed
        cut = first_stop(toks[:room], dec.stop_ids)
        if cut is not None or p >= room:
            s.out += toks[: cut + 1] if cut is not None else toks[:room]
            s.done, s.finish_reason = True, FinishReason.stop if cut is not None else FinishReason.length
            return items
        if p < front.length or not dec.can_retire(front):
            break
        s.retired.append(s.canvases.pop(0))
        s.out += toks
        s.stats["retired"] += 1
        item = dec.retire(s, front, continues=True)
        if item is not None:
            items.append(item)
    if not s.canvases and s.spawned >= s.n_canvases:  # nothing left to decode
        s.done = True
        return items
    ended = any(  # a committed EOS or PAD in a live canvas: no canvas after it
        bool((cv.committed & ((cv.tokens == dec.eos_id) | (cv.tokens == dec.bundle.pad_id))).any())
        for cv in s.canvases
    )
    if not ended and s.spawned < s.n_canvases:
        if not s.canvases:
            dec.spawn(s)
        elif len(s.canvases) < cfg.max_canvases:
            last = s.canvases[-1]  # a revising front's share of confident positions counts (front.py)
            warm = max(last.decoded, last.settled) >= cfg.spawn_threshold
            if warm or dec.early_spawn(s):
                s.stats["early_spawns"] += int(not warm)
                dec.spawn(s)
    graduate(s.canvases, cfg.tau_add, cfg.tau_act, cfg.draft_only)
    return items


def graduate(canvases: list[Canvas], tau_add: float, tau_act: float, draft_only: bool) -> None:
    """The front is full; behind it a canvas becomes semi when its predecessor's decode fraction
    reaches τ_add and full at τ_act (states never drop), unless draft-only keeps it a draft."""
    for i, cv in enumerate(canvases):
        if i == 0:
            cv.state = "full"
        elif not draft_only:
            prev = canvases[i - 1].decoded
            if prev >= tau_act:
                cv.state = "full"
            elif prev >= tau_add and cv.state == "draft":
                cv.state = "semi"


def encode_pass(dec: StepDecoder, encodes: list[tuple[Seq, list[tuple]]]) -> None:
    """One causal encoder pass writing each sequence's items (slot, ids, positions; several retired
    canvases joined in order) to the cache, traced as an "encode" pass: pipe's retire pass (funnel's
    with `retire_refresh` or `shrink=False`), the same as phcd's `promote="encode"` pass."""
    batch = [
        (s, (s.slot, torch.cat([it[1] for it in items]), torch.cat([it[2] for it in items])))
        for s, items in encodes
        if items
    ]
    if not batch:
        return
    with dec.timed() as t:
        dec.encode([item for _, item in batch])
    rows = {s.row: int(item[1].numel()) for s, item in batch}
    dec.record("encode", t, rows, {}, {s.row: "commit" for s, _ in batch})  # read after the next sync
