"""The decode loop's forwards through cached CUDA graphs on one persistent arena (`GraphRunner`).

Flow: the decoder's windows (a list of `Window`s) → `pad_window` to the bucket → the static
buffers of a `DecodeGraph` (`model.decode_graph`) → one graph launch; the runner keys, builds, keeps
and evicts the graphs, and runs eagerly what no graph can take."""

from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict

import torch

from canvasq.model.arena import KVArena
from canvasq.model.decode_graph import (
    CONTEXT_BUCKET,
    PAD_POSITION,
    ROW_BUCKETS,
    DecodeGraph,
    _bucket,
    _sc_kind,
    context_bucket,
    pad_window,
)
from canvasq.model.runtime import DecodeOutput, Runtime, Window, encoder_windows

__all__ = [
    "ARENA_BYTES",
    "CONTEXT_BUCKET",
    "LOGITS_BYTES",
    "PAD_POSITION",
    "ROW_BUCKETS",
    "DecodeGraph",
    "GraphRunner",
    "context_bucket",
    "graph_runner",
    "graph_totals",
    "pad_window",
]

# GraphRunner's default arena cap (None: none, the stream's arena, which it allocates anyway, is the
# runner's at any size). The graphs' shared fp32 logits buffer bounds the padded rows a graph may take:
# 2 GiB is 2,048 rows at the real vocabulary (8 windows of 256), so graphs take the small forwards,
# which are bound by their launches, and the large ones, bound by the GPU, run eagerly on the same
# arena. On an H100 at 32 slots, each arm its own process, this gave 11,151 and 11,512 committed tok/s
# against a 16 GiB cap's 9,694 and 10,619 (BENCHMARKS.md, "Service throughput").
ARENA_BYTES: int | None = None
LOGITS_BYTES = 2 << 30
# Padded rows up to which a forward past the logits buffer still replays a graph, one that stops at the
# final-normed hidden rows (their LM head runs when the decoder reads them, as an eager forward's
# deferred head does). 0: those forwards run eagerly. Why: an eager 16 x 256 forward is bound by its
# host (101.7 ms of wall time for 52.25 ms of GPU work on an H200); as a graph its wall time is its GPU
# time, and through the loop such graphs gave 11,650-11,833 committed tok/s against 10,240-10,946 on an
# H100 (BENCHMARKS.md, "Persistent grouped GEMM, PDL, routing order and deferred heads"). Off until the
# GPU guard, with the testbed's forwards sent through such graphs, scores as the plain graphs do.
DEFERRED_ROWS = 0

log = logging.getLogger(__name__)


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
    than the logits buffer holds (unless `deferred_rows` lets a graph that defers its LM head take
    them), a window larger than the largest row bucket, padded rows that would not fit a slot's free
    entries, or a key whose graph failed to build (counted in `stats["failed"]`).

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
        deferred_rows: int = DEFERRED_ROWS,
    ):
        self.rt, self.max_arena_bytes, self.deferred_rows = rt, max_arena_bytes, deferred_rows
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
        return rows <= ROW_BUCKETS[-1] and rows * windows <= max(self.max_rows, self.deferred_rows)

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

    def set_limits(self, logits_bytes: int | None = None, deferred_rows: int | None = None) -> None:
        """A new logits buffer size and/or `deferred_rows` (None: keep); on a change the graphs go
        (`release`): they write the old buffer, and which of them defer their head depends on both."""
        want = (
            self.logits_bytes if logits_bytes is None else logits_bytes,
            self.deferred_rows if deferred_rows is None else deferred_rows,
        )
        if want != (self.logits_bytes, self.deferred_rows):
            self.logits_bytes, self.deferred_rows = want
            self.release()

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
            rows * len(slots) > self.max_rows,  # past the logits buffer: the head deferred
        )
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        graph = self.graphs[key] = self._build(arena, windows, rows, context, encoder, key[-1])
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return graph

    def _build(
        self, arena: KVArena, windows: list[Window], rows: int, context: int, encoder: bool, deferred: bool
    ) -> DecodeGraph | None:
        """A graph over the runner's own arena (`arena` is `self.store`); `deferred`: its head too."""
        if self.logits is None and not deferred:
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
                logits_out=None if deferred else self.logits,
                encoder=encoder,
                defer_head=deferred,
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
