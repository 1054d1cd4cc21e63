"""CUDA-graph replay of decoder forwards, with windows padded to row buckets.

Flow: the decoder's windows (a list of `Window`s) → `pad_window` to the bucket → the static
buffers of a `DecodeGraph` → one graph launch. See `DecodeGraph` for what is fixed at build and what
may change between runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import Counter, OrderedDict

import torch

from canvasq.model.arena import Captured, KVArena
from canvasq.model.runtime import DecodeOutput, Runtime, Window, encoder_windows
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


ARENA_BYTES = 16 << 30  # GraphRunner's default arena cap: a batch whose arena is larger decodes eagerly
# The graphs' shared fp32 logits buffer, which bounds the padded rows a graph may take (16,384 rows at
# the real vocabulary). A smaller one keeps graphs to the launch-bound small forwards;
# `official_service.py --arena-gib CAP:ROWS` A/Bs that (BENCHMARKS.md, "Service throughput").
LOGITS_BYTES = 16 << 30
ROW_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXT_BUCKET = 256  # a graph's context (arena entries it reads) is rounded up to a multiple of this


def context_bucket(entries: int, capacity: int | None = None) -> int:
    """`entries` rounded up to a multiple of CONTEXT_BUCKET, at most `capacity`."""
    rounded = -(-entries // CONTEXT_BUCKET) * CONTEXT_BUCKET
    return rounded if capacity is None else min(capacity, rounded)


log = logging.getLogger(__name__)


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
        if self.uniform and self._uniform(windows):
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
        if all(w.rows == self.rows for w in windows):
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
        p, rows, dev = self.prep, self.rows, self.rt.device
        slots = [w.slot for w in windows]
        starts = [self.arena.reserve(s, rows) for s in slots]  # the scratch entries, as `prepare` takes them
        torch.cat([w.token_ids for w in windows], out=p.ids)
        torch.cat([w.positions for w in windows], out=p.pos)
        torch.cat([w.canvas_end for w in windows], out=p.ctx.hi.view(-1))
        torch.cat([w.canvas_start for w in windows], out=p.ctx.lo.view(-1))
        p.ctx.lo.sub_(self.rt.sliding_window - 1)
        first = to_device(starts, dev)
        torch.add(first[:, None], self._cols, out=p.row_col.view(len(slots), rows))
        torch.add(first, rows, out=p.ctx.ends)
        if slots != self._last_slots:
            at = to_device(slots, dev)
            p.ctx.slots.copy_(at)
            p.row_slot.view(len(slots), rows).copy_(at[:, None].expand(-1, rows))
            self._last_slots = slots
        if p.sc:
            _, keep, (ids, vals) = p.sc[0]
            on = self._on
            keep.view(-1).copy_(
                torch.cat([on if w.self_cond_rows is None else w.self_cond_rows for w in windows])
            )
            torch.cat([w.self_cond[0] for w in windows], out=ids)  # type: ignore[index]
            torch.cat([w.self_cond[1] for w in windows], out=vals)  # type: ignore[index]

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


class GraphRunner:
    """The decode loop's forwards (decoder steps and encoder passes) through cached `DecodeGraph`s on
    one persistent arena (one runner per `Runtime`, so per worker process and model).

    A CUDA graph keeps the addresses of every tensor it reads, so the arena outlives a batch:
    `arena(slots, capacity)` hands out the runner's own arena with every slot reset, replacing it (and
    dropping the graphs) only when a batch needs more slots or entries than it has, and never larger
    than `max_arena_bytes` when that is set (a batch beyond it gets no runner arena and decodes
    eagerly; None: the stream's arena, which it would allocate anyway, is the runner's). Graphs are keyed
    by (encoder or decoder, window count, first slot when the slots are consecutive, row bucket,
    context bucket, SC kinds, the attention path), kept least recently used up to `max_graphs`, and share one temporaries
    pool and one logits buffer of `logits_bytes` (`LOGITS_BYTES`). `decode` and `encode_many` run eagerly
    what no graph can take: windows on another store (the funnel's simple promotion), more padded rows
    than the logits buffer holds, a window larger than the largest row bucket, padded rows that would not
    fit a slot's free entries, or a key whose graph failed to build (counted in `stats["failed"]`).

    Numerics: a graph forward pads rows to the bucket and always applies the attention masks (no
    host sync to detect mask-free segments), so its logits equal the eager forward's to rounding,
    not bit for bit; seeded runs through the runner still repeat exactly.
    """

    def __init__(
        self,
        rt: Runtime,
        max_graphs: int = 256,
        logits_bytes: int = LOGITS_BYTES,
        cuda_graph: bool | None = None,
        warmup: int = 1,
        max_arena_bytes: int | None = ARENA_BYTES,
    ):
        self.rt, self.max_arena_bytes = rt, max_arena_bytes
        self.cuda_graph = rt.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.max_graphs, self.warmup, self.logits_bytes = max_graphs, warmup, logits_bytes
        self.graphs: OrderedDict[tuple, DecodeGraph | None] = OrderedDict()
        self.store: KVArena | None = None
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.logits: torch.Tensor | None = None
        self.stats = {"built": 0, "replayed": 0, "eager": 0, "evicted": 0, "failed": 0}
        self.eager_reasons: Counter[str] = Counter()  # why `_graph` left a forward eager (benchmarks read it)
        _RUNNERS.add(self)

    @property
    def max_rows(self) -> int:
        """Padded rows (all windows of a forward) a graph may have: the logits buffer's size."""
        return max(ROW_BUCKETS[0], self.logits_bytes // (4 * self.rt.vocab_size))

    def takes(self, windows: int, rows: int) -> bool:
        """Whether a forward of `windows` windows of up to `rows` rows can replay a graph (in the
        runner's arena); a larger one runs eagerly, where padding it to a bucket would only add work."""
        rows = _bucket(rows, ROW_BUCKETS)
        return rows <= ROW_BUCKETS[-1] and rows * windows <= self.max_rows

    def arena(self, slots: int, capacity: int) -> KVArena | None:
        """The persistent arena, every slot empty, with at least `slots` slots of `capacity` entries;
        None when that would hold more than `max_arena_bytes` for the life of the process (the caller
        then allocates its own arena for the batch, whose forwards run eagerly)."""
        a = self.store
        if a is None or a.slots < slots or a.capacity < capacity:
            want = (slots, context_bucket(capacity))
            grown = want if a is None else (max(slots, a.slots), max(want[1], a.capacity))
            cap = self.max_arena_bytes
            if cap is not None and self._arena_bytes(*grown) > cap:  # grow to cover both batches if
                grown = want  # that fits, so alternating shapes do not thrash; else just this one
                if self._arena_bytes(*grown) > cap:
                    return None
            self.release()  # the graphs read the old arena's tensors (and their logits buffer)
            a = self.store = self.rt.new_arena(slots=grown[0], capacity=grown[1])
        for s in range(a.slots):
            a.reset(s)
        return a

    def release(self) -> None:
        """Drop the arena, the graphs and their logits buffer (a new arena; a stream that ran out of
        device memory, so the next one, on fewer slots, does not find them still allocated)."""
        self.graphs.clear()
        self.store = self.logits = None
        # and a new pool: once its last graph is gone, torch frees a pool and refuses new captures
        # into its handle
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None

    def _arena_bytes(self, slots: int, capacity: int) -> int:
        return KVArena.bytes_for(self.rt.layer_shapes, slots, capacity, self.rt.dtype)

    @torch.no_grad()
    def decode(
        self, arena: KVArena, windows: list[Window], prefix_attention: bool | None = None
    ) -> DecodeOutput:
        """`Runtime.decode` through a graph when one can take these windows (see the class)."""
        graph = self._graph(arena, windows, encoder=False)
        if graph is None:
            self.stats["eager"] += 1
            return self.rt.decode(arena, windows, prefix_attention=prefix_attention)
        self.stats["replayed"] += 1
        out = graph.run(windows)
        assert out is not None  # a decoder graph has logits
        return out

    @torch.no_grad()
    def encode_many(self, arena: KVArena, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """`Runtime.encode_many` (prefill, a retired canvas) through a graph when one can take it."""
        windows = encoder_windows(items)
        graph = self._graph(arena, windows, encoder=True)
        if graph is None:
            self.stats["eager"] += 1
            self.rt.encode_many(arena, items)
            return
        self.stats["replayed"] += 1
        graph.run(windows)
        for w in windows:
            arena.commit(w.slot, w.rows)

    def _graph(self, arena: KVArena, windows: list[Window], encoder: bool) -> DecodeGraph | None:
        """The cached (or a new) graph for these windows; None: run them eagerly."""
        rows = _bucket(max(w.rows for w in windows), ROW_BUCKETS)
        if arena is not self.store:
            self.eager_reasons["other arena"] += 1
            return None
        if not self.takes(len(windows), rows):
            self.eager_reasons["too many rows"] += 1
            return None
        need = max(arena.length[w.slot] for w in windows) + rows
        if need > arena.capacity:  # the real rows may fit where the padded ones do not
            self.eager_reasons["past capacity"] += 1
            return None
        context = context_bucket(need, arena.capacity)
        slots = [w.slot for w in windows]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        rt = self.rt
        key = (
            encoder,
            len(slots),
            slots[0] if consecutive else None,
            rows,
            context,
            tuple(_sc_kind(w.self_cond) for w in windows),
            # the attention and SC bag a capture bakes in (knobs a benchmark arm may change between forwards)
            (rows <= rt.kernel_rows, rt.attention_tiles, rt.sdpa_backend, rt.encoder_sdpa_backend, rt.sc_bag),
        )
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        graph = self.graphs[key] = self._build(arena, windows, rows, context, encoder)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return graph

    def _build(
        self, arena: KVArena, windows: list[Window], rows: int, context: int, encoder: bool
    ) -> DecodeGraph | None:
        """A graph over the runner's own arena (`arena` is `self.store`)."""
        if self.logits is None:
            n = min(self.max_rows, arena.slots * ROW_BUCKETS[-1])
            self.logits = torch.empty(n * self.rt.vocab_size, dtype=torch.float32, device=self.rt.device)
        try:
            graph = DecodeGraph(
                self.rt,
                arena,
                windows,
                rows=rows,
                context=context,
                cuda_graph=self.cuda_graph,
                warmup=self.warmup,
                pool=self.pool,
                logits_out=self.logits,
                encoder=encoder,
            )
        except (RuntimeError, ValueError):  # CUDA / capture / out-of-memory / shape errors: a graph
            # is an optimisation, the rows still decode eagerly. Anything else (the worker's soft
            # time limit fires as an Exception, not a RuntimeError) must reach the decode loop.
            log.exception(
                "CUDA graph for %d x %d rows failed: eager forwards for that shape", len(windows), rows
            )
            self.stats["failed"] += 1
            return None
        self.stats["built"] += 1
        return graph


_RUNNERS: weakref.WeakSet[GraphRunner] = weakref.WeakSet()  # every live runner of this process


def graph_totals() -> dict[str, int]:
    """`GraphRunner.stats` summed over this process's live runners (what `canvasq run` reports)."""
    out = {"built": 0, "replayed": 0, "eager": 0, "evicted": 0, "failed": 0}
    for runner in list(_RUNNERS):
        for k, v in runner.stats.items():
            out[k] = out.get(k, 0) + v
    return out


def graph_runner(rt: Runtime, cuda_graph: bool | None = None) -> GraphRunner:
    """The runtime's `GraphRunner` (made on first use; `cuda_graph=False` is the CPU-testable path
    through the same prepared forwards)."""
    runner = rt.graph_runner
    want = rt.device.type == "cuda" if cuda_graph is None else cuda_graph
    if runner is None or runner.cuda_graph != want:
        runner = rt.graph_runner = GraphRunner(rt, cuda_graph=want)
    return runner
