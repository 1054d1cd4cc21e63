"""One forward replayed with new inputs (`DecodeGraph`): windows padded to a row bucket (`pad_window`),
written into the static buffers of a prepared forward, replayed as one CUDA graph launch. See
`DecodeGraph` for what is fixed at build and what may change between runs; `graph.GraphRunner` keeps
a cache of them for the decode loop."""

from __future__ import annotations

import contextlib
import functools

import torch

from canvasq.model.arena import Captured, KVArena
from canvasq.model.runtime import DecodeOutput, Runtime, Window
from canvasq.model.windows import to_device

PAD_POSITION = 1 << 30  # padding rows sit far beyond any real position: no real row ever sees them


def pad_window(w: Window, rows: int) -> Window:
    """`w` with dummy rows appended up to `rows` (a bucket size). A padding row has token 0, a position
    beyond every real one (so real rows never see it), sees only itself and takes no SC signal; its
    logits are meaningless. When `w` has SC, the result always carries `self_cond_rows`."""
    r = w.rows
    if rows < r:
        raise ValueError(f"window of {r} rows does not fit a bucket of {rows}")
    extra = rows - r
    if extra == 0 and (w.self_cond is None or w.self_cond_rows is not None):
        return w
    dev = w.token_ids.device
    pad_pos = PAD_POSITION + torch.arange(extra, device=dev)

    def cat(t, fill=None):  # the padding made where `t` is (a host tensor's copy would sync the stream)
        fill = torch.zeros(extra, *t.shape[1:], dtype=t.dtype, device=t.device) if fill is None else fill
        return torch.cat([t, fill.to(t.device, t.dtype)])

    sc, sc_rows = w.self_cond, None
    if sc is not None:
        sc = (cat(sc[0]), cat(sc[1])) if isinstance(sc, tuple) else cat(sc)
        keep = (
            w.self_cond_rows if w.self_cond_rows is not None else torch.ones(r, dtype=torch.bool, device=dev)
        )
        sc_rows = cat(keep.bool())
    return Window(
        w.slot,
        cat(w.token_ids),
        cat(w.positions, pad_pos),
        cat(w.canvas_start, pad_pos),
        cat(w.canvas_end, pad_pos + 1),
        capture=None if w.capture is None else cat(w.capture.bool()),
        self_cond=sc,
        self_cond_rows=sc_rows,
    )


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return n


ROW_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXT_BUCKET = 256  # a graph's context (arena entries it reads) is rounded up to a multiple of this


def context_bucket(entries: int, capacity: int | None = None) -> int:
    """`entries` rounded up to a multiple of CONTEXT_BUCKET, at most `capacity`."""
    rounded = -(-entries // CONTEXT_BUCKET) * CONTEXT_BUCKET
    return rounded if capacity is None else min(capacity, rounded)


class DecodeGraph:
    """A decoder forward replayed with new inputs: a CUDA graph on CUDA (one launch per step instead
    of thousands), the same prepared forward elsewhere (so CPU tests cover its buffer logic).
    `encoder=True` makes it an encoder pass instead (`Runtime.encode_many`'s causal windows: `run`
    writes their K/V into the arena's scratch and returns None; the caller commits the lengths).

    Fixed at build: the windows' slots (same order), `rows` per window (a bucket: every window is
    padded to it with `pad_window`), the SC kind of each window (none / full / top-k with its k) and
    `context`, the number of arena entries a forward may read (a bucket >= length + rows of every
    slot, <= capacity). Free per `run`: token ids, positions, canvas bounds, capture rows, SC inputs
    and the arena contents (lengths may grow by `encode` / `promote` while they fit `context`), so
    one graph serves a whole Funnel / pipe decode loop while the window fits its bucket.

    Slots: windows on consecutive slots read the arena through a view, and the graph replays only on
    those slots; otherwise the slots are a device index like the rest, and the graph replays on any
    slots (same count), so a decode loop whose rows finish in any order keeps its graphs.

    `pool` (`torch.cuda.graph_pool_handle()`): graphs built with the same pool share the memory of
    their temporaries, so a cache of buckets costs one forward's activations plus each graph's
    logits, not one full forward's memory per bucket. `logits_out` (a contiguous fp32 buffer with
    room for rows x vocabulary) takes the logits too, so a cache holds one logits buffer in all.
    Safe because graphs of one decode loop never run concurrently and `run` copies its logits out
    (and reads captured K/V from the arena) before any other graph replays.
    """

    def __init__(
        self,
        rt: Runtime,
        arena: KVArena,
        windows: list[Window],
        rows: int | None = None,
        context: int | None = None,
        cuda_graph: bool | None = None,
        warmup: int = 2,
        pool=None,
        logits_out: torch.Tensor | None = None,
        encoder: bool = False,
        defer_head: bool = False,
    ):
        self.rt, self.arena, self.encoder = rt, arena, encoder
        self.rows = rows or _bucket(max(w.rows for w in windows), ROW_BUCKETS)
        need = max(arena.length[w.slot] for w in windows) + self.rows
        self.context = context or context_bucket(need, arena.capacity)
        self.slots = [w.slot for w in windows]
        self.sc_kinds = [_sc_kind(w.self_cond) for w in windows]
        self.prep = rt._prepare(
            arena,
            [pad_window(w, self.rows) for w in windows],
            encoder=encoder,
            lmax=self.context,
            capture=False,
        )
        self.prep.static = True
        self.prep.logits_out = logits_out
        # the graph stops at the final-normed hidden rows; their logits are made when read
        self.prep.defer_head = defer_head and not encoder
        self.any_slots = not self.prep.ctx.contiguous
        self.uniform = self._uniform(windows)
        self._last_slots = self.slots
        # own every buffer a run overwrites (a payload may alias the caller's tensor)
        self.prep.sc = [
            (r, keep.clone(), tuple(t.clone() for t in pay) if isinstance(pay, tuple) else pay.clone())
            for r, keep, pay in self.prep.sc
        ]
        self.cuda_graph = rt.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.graph = None
        if self.cuda_graph:
            scope, rt.scope = rt.scope, (lambda name: contextlib.nullcontext())
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), torch.no_grad():
                    for _ in range(warmup):  # compiles Triton kernels, warms the allocator and cuBLAS
                        rt._run(self.prep)
                torch.cuda.current_stream().wait_stream(stream)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
                    self._logits = rt._run(self.prep)[0]
            finally:
                rt.scope = scope

    @torch.no_grad()
    def run(self, windows: list[Window]) -> DecodeOutput | None:
        """Decode `windows` (same slots and SC kinds as at build, each at most `rows` rows) through
        the graph. Logits are copied out (real rows only); captured K/V are read from the scratch.
        An encoder graph returns None."""
        slots = [w.slot for w in windows]
        if slots != self.slots and not (self.any_slots and len(slots) == len(self.slots)):
            raise ValueError(f"DecodeGraph built for slots {self.slots}")
        if [_sc_kind(w.self_cond) for w in windows] != self.sc_kinds:
            raise ValueError(f"DecodeGraph built for self-conditioning kinds {self.sc_kinds}")
        if self.encoder and self.prep.ctx.dense:
            self._write_encoder(windows)
        elif self.uniform and self._uniform(windows):
            self._write_uniform(windows)
        else:
            self._write(windows)
        p = self.prep
        if self.graph is not None:
            self.graph.replay()
            logits = self._logits
        else:
            logits = self.rt._run(p)[0]
        if self.encoder:
            return None

        offsets = [0]
        for w in windows:
            offsets.append(offsets[-1] + w.rows)
        if all(w.rows == self.rows for w in windows):  # the logits, or deferred: the hidden rows
            logits = logits.clone()
        else:
            real = [torch.arange(b * self.rows, b * self.rows + w.rows) for b, w in enumerate(windows)]
            logits = logits.index_select(0, to_device(torch.cat(real), logits.device))
        captured: list[Captured | None] = []
        for w, start in zip(windows, (self.arena.length[s] for s in slots)):
            if w.capture is None or not bool(w.capture.any()):
                captured.append(None)
                continue
            idx = torch.nonzero(w.capture.to(self.rt.device)).flatten()
            cols = idx + start
            ks = [k[w.slot][:, cols].transpose(0, 1) for k in self.arena.k]
            vs = [v[w.slot][:, cols].transpose(0, 1) for v in self.arena.v]
            captured.append(Captured(ks, vs, w.positions.to(self.rt.device)[idx]))
        if p.defer_head:
            return self.rt.deferred_output(logits, offsets, captured, rows=self.rows * len(windows))
        return DecodeOutput(logits, offsets, captured)

    def _write(self, windows: list[Window]) -> None:
        """The forward's inputs into the static buffers, through `prepare` (any windows)."""
        padded = [pad_window(w, self.rows) for w in windows]
        new = self.rt._prepare(self.arena, padded, encoder=self.encoder, lmax=self.context, capture=False)
        p = self.prep
        for dst, src in (
            (p.ids, new.ids),
            (p.pos, new.pos),
            (p.row_slot, new.row_slot),
            (p.ctx.slots, new.ctx.slots),
            (p.row_col, new.row_col),
            (p.ctx.hi, new.ctx.hi),
            (p.ctx.lo, new.ctx.lo),
            (p.ctx.ends, new.ctx.ends),
            (p.ctx.pad, new.ctx.pad),
        ):
            dst.copy_(src)
        for (_, keep_d, pay_d), (_, keep_s, pay_s) in zip(p.sc, new.sc):
            keep_d.copy_(keep_s)
            for d, s in zip(
                pay_d if isinstance(pay_d, tuple) else (pay_d,),
                pay_s if isinstance(pay_s, tuple) else (pay_s,),
            ):
                d.copy_(s)
        self._last_slots = [w.slot for w in windows]

    def _uniform(self, windows: list[Window]) -> bool:
        """Whether the windows are the decode loop's common step: a decoder forward of one canvas per
        window, each exactly `rows` rows (no padding rows), with no capture, no encoder rows and one
        top-k self-conditioning entry for all of them or none. `_write_uniform` then writes the
        buffers with a few batched copies instead of `prepare`'s few per window."""
        p = self.prep
        if self.encoder or not p.ctx.dense or len(p.sc) > 1 or (p.sc and not isinstance(p.sc[0][2], tuple)):
            return False
        kind = tuple if p.sc else type(None)  # every window's SC a top-k signal, or none's
        dev = p.ids.device
        return all(
            w.rows == self.rows
            and w.capture is None
            and not w.encoder_rows
            and isinstance(w.self_cond, kind)
            and w.token_ids.device == dev
            for w in windows
        )

    def _write_uniform(self, windows: list[Window]) -> None:
        """`_write` for uniform windows (`_uniform`): the same buffer contents, each buffer written by
        one batched copy (cat into it), and the slots' index only when the slots changed."""
        p = self.prep
        self._write_places([w.slot for w in windows])
        torch.cat([w.token_ids for w in windows], out=p.ids)
        torch.cat([w.positions for w in windows], out=p.pos)
        torch.cat([w.canvas_end for w in windows], out=p.ctx.hi.view(-1))
        torch.cat([w.canvas_start for w in windows], out=p.ctx.lo.view(-1))
        p.ctx.lo.sub_(self.rt.sliding_window - 1)
        if p.sc:
            _, keep, (ids, vals) = p.sc[0]
            on = self._on
            keep.view(-1).copy_(
                torch.cat([on if w.self_cond_rows is None else w.self_cond_rows for w in windows])
            )
            torch.cat([w.self_cond[0] for w in windows], out=ids)  # type: ignore[index]
            torch.cat([w.self_cond[1] for w in windows], out=vals)  # type: ignore[index]

    def _write_encoder(self, windows: list[Window]) -> None:
        """`_write` for an encoder pass (`encoder_windows`: causal rows, canvas start = position,
        canvas end = position + 1, no self-conditioning): each window's ids and positions with its
        padding rows' (`pad_window`'s zeros and far positions, as views of two fixed tensors) in one
        cat each, the bounds from the positions, the entries from the slots' lengths: a few launches
        a pass, where `pad_window` and `prepare` take several a window."""
        p, rows, dev = self.prep, self.rows, self.rt.device
        if any(w.rows > rows for w in windows):  # a cat into the static buffers would resize them
            raise ValueError(
                f"an encoder window of {max(w.rows for w in windows)} rows in a {rows}-row graph"
            )
        self._write_places([w.slot for w in windows])
        ids: list[torch.Tensor] = []
        pos: list[torch.Tensor] = []
        for w in windows:
            ids.append(w.token_ids.to(dev))
            pos.append(w.positions.to(dev))
            if w.rows < rows:
                ids.append(self._pad_ids[: rows - w.rows])
                pos.append(self._pad_pos[: rows - w.rows])
        torch.cat(ids, out=p.ids)
        torch.cat(pos, out=p.pos)
        torch.add(p.pos, 1, out=p.ctx.hi.view(-1))
        torch.sub(p.pos, self.rt.sliding_window - 1, out=p.ctx.lo.view(-1))

    def _write_places(self, slots: list[int]) -> None:
        """The windows' scratch entries (`row_col`, `ends`) from their slots' lengths, as `prepare`
        reserves them, and the slots' index when the slots changed since the last run."""
        p, rows, dev = self.prep, self.rows, self.rt.device
        first = to_device([self.arena.reserve(s, rows) for s in slots], dev)
        torch.add(first[:, None], self._cols, out=p.row_col.view(len(slots), rows))
        torch.add(first, rows, out=p.ctx.ends)
        if slots != self._last_slots:
            at = to_device(slots, dev)
            p.ctx.slots.copy_(at)
            p.row_slot.view(len(slots), rows).copy_(at[:, None].expand(-1, rows))
            self._last_slots = slots

    @functools.cached_property
    def _pad_ids(self) -> torch.Tensor:
        return torch.zeros(self.rows, dtype=torch.long, device=self.rt.device)

    @functools.cached_property
    def _pad_pos(self) -> torch.Tensor:
        return PAD_POSITION + torch.arange(self.rows, device=self.rt.device)

    @functools.cached_property
    def _cols(self) -> torch.Tensor:
        return torch.arange(self.rows, device=self.rt.device)

    @functools.cached_property
    def _on(self) -> torch.Tensor:
        return torch.ones(self.rows, dtype=torch.bool, device=self.rt.device)


def _sc_kind(sc) -> str:
    if sc is None:
        return "none"
    if isinstance(sc, tuple):
        return f"top{sc[0].shape[1]}"
    return "full"
