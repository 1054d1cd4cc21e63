"""The loop every step-based decoder shares: batch state, prefill, cancellation, per-row errors,
traces, the encoder passes of retired canvases (at once, deferred to the next prefill pass or folded
into the next decoder forward: `windows.canvas_window`) and where an answer ends. A strategy
(official, pipe, funnel, phcd) implements `step()`: one decoder forward for every live sequence of the
batch, its commit rules, retires (`retire_canvases` where a canvas ends whole) and spawns.

Flow: DecodeBatch → `Seq` per request (arena slot, RNG, live canvases) → `step()` builds
the forward's windows (one `Window` per live sequence) → `Runtime.decode` → commits → DecodeResult.

Continuous batching: `stream(feed, on_result, slots)` keeps up to `slots` requests in flight, takes new
ones from `feed` as rows finish (their prompts encoded in one pass, then they join the next step) and
hands each finished row to `on_result` at once; `decode(batch)` is a stream over one batch.

Accounting and timing: every model pass is recorded per request it carried (`traces.PassLog`) and
timed with `timed()` (`traces.PassTimer`: CUDA events on CUDA, read lazily). Latency marks:
`stats["first_token_pass"]` / `stats["first_window_pass"]` are how many of the row's passes had run
when its final, streamable prefix (`emitted`) first held one token / one canvas (a row that ends
shorter: its last pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import torch

from canvasq.decoders import runtimes
from canvasq.decoders.slots import SlotPool
from canvasq.decoders.state import Cancelled, Canvas, Seq, error_result, first_stop, poll, row_generator
from canvasq.decoders.traces import PassLog, PassTimer
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    Interrupted,
)
from canvasq.model.windows import to_device

if TYPE_CHECKING:
    from canvasq.model.arena import KVArena

K = TypeVar("K")  # the key a fed request comes with and its result goes back with (`stream`)

# windows per graphed forward: a live count is padded up to the next bucket (one graph per bucket)
WINDOW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class StepDecoder:
    """Base class: owns the loop. Subclasses implement `step(seqs)`."""

    name = "base"
    config_cls: type = object

    def __init__(self, bundle, config=None) -> None:
        self.bundle = bundle
        self.config = config if config is not None else self.config_cls()
        self.model = self.pick_model()
        self.rt = runtimes.runtime_for(
            self.model,
            self.config.experts,
            getattr(self.config, "fp8", "off"),
            getattr(self.config, "fp8_min_rows", 0),
            encoder_model=self.pick_encoder_model(),
        )
        self.C = bundle.canvas_length
        self.eos_id = bundle.eos_id
        self.stop_ids = frozenset({bundle.eos_id, bundle.pad_id})
        self.device = self.rt.device
        self.log = PassLog()  # the stream's traces (set by `stream`)
        self._deferred: list[tuple[Seq, tuple]] = []  # (row, encoder item) for the next prefill pass
        self.pool: SlotPool | None = None  # the stream's slots (set by `stream`)
        self.arena: KVArena | None = None  # the stream's KV cache (set by `stream`)
        self.graphs = self.graph_runner()

    def pick_model(self):
        """`adapter_path`'s LoRA merged (unless `adapter` is off), else the D2F adapter when `adapter`."""
        if getattr(self.config, "adapter_path", None) and getattr(self.config, "adapter", True):
            from canvasq.decoders.adapters import merged_model

            return merged_model(self.bundle, self.config.adapter_path)
        return self.bundle.d2f_model() if getattr(self.config, "adapter", False) else self.bundle.hf_model

    def pick_encoder_model(self):
        """The base model for the encoder passes when the adapter is kept to the decoder steps
        (`adapter_encoder=false`), else None: the encoder runs `pick_model()`'s (tied) weights."""
        if getattr(self.config, "adapter_encoder", True) or self.model is self.bundle.hf_model:
            return None
        return self.bundle.hf_model

    def graph_runner(self):
        """The runtime's `GraphRunner` when this decoder's forwards go through CUDA graphs, else None."""
        mode = getattr(self.config, "cuda_graphs", "off")
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        from canvasq.model.graph import graph_runner

        return graph_runner(self.rt, cuda_graph=self.device.type == "cuda")

    # -- the loop -------------------------------------------------------------------------------
    def decode(
        self, batch: DecodeBatch, should_stop=None, interrupts: tuple[type[BaseException], ...] = ()
    ) -> list[DecodeResult]:
        """Every request of `batch` at once (as many slots as requests); results in request order."""
        results: dict[int, DecodeResult] = {}
        todo = list(enumerate(batch.requests))

        def feed(n: int):
            taken, todo[:] = todo[:n], todo[n:]
            return taken

        try:
            self.stream(
                feed,
                results.__setitem__,
                slots=max(1, len(todo)),
                seed=batch.seed,
                capacity=self.capacity_for(batch.requests),
                should_stop=should_stop,
                interrupts=interrupts,
            )
        except Interrupted as cut:  # the caller's time limit: hand back the rows that finished
            raise Interrupted(cut.cause, [r for r in results.values() if r.error is None]) from cut.cause
        for i, req in todo:  # never fed: the run was cancelled first
            results[i] = error_result(req, CANCELLED, self.name, CANCELLED)
        return [results[i] for i in range(len(batch.requests))]

    def stream(
        self,
        feed: Callable[[int], list[tuple[K, DecodeRequest]]],
        on_result: Callable[[K, DecodeResult], None],
        slots: int,
        seed: int = 0,
        capacity: int | None = None,
        should_stop=None,
        interrupts: tuple[type[BaseException], ...] = (),
        occupancy: list | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        """Continuous batching: keep up to `slots` requests in flight, refilled as rows finish.

        `feed(n)` returns up to n new (key, request) pairs; an empty list means nothing more will come.
        `on_result(key, result)` receives each row the moment it ends (done, failed or cancelled);
        `flush()`, if given, follows the rows handed over at one point of the loop (an admission, a
        step's end), before the next forward: a caller that stores rows writes them there together.
        `capacity`: arena entries per slot, fixed for the stream (callers pass `capacity_for` of every
        request they may feed); a fed request that needs more fails alone. `occupancy`, if given,
        receives (live rows, slots) per decoder step. Cancellation stops feeding and ends the rows in
        flight as CANCELLED; one of `interrupts` raises `Interrupted` (rows already handed to
        `on_result` are not repeated)."""
        self.log = PassLog()
        self._deferred = []
        self.arena = self.new_arena(slots, capacity) if capacity else None
        pool = self.pool = SlotPool(self, slots, seed, capacity or 0, on_result, flush)
        self.new_stream(slots)
        self.last_seqs = pool.seen
        exhausted = False
        try:
            while True:
                fresh = []
                if pool.free and not exhausted:
                    new = feed(len(pool.free))
                    exhausted = not new
                    fresh = pool.admit(new)
                if not pool.live:
                    if exhausted:
                        break
                    continue
                poll(should_stop)  # between forwards; a cancel ends the fed rows too
                if fresh or self._deferred:  # new prompts and the commits left for this pass, together
                    carried = fresh + [s for s, _ in self._deferred if not s.done]
                    self._guarded(self.prefill, carried, fresh, interrupts)
                    self.note_emitted(fresh)
                    pool.deliver_done()
                    if not pool.live:
                        continue
                if occupancy is not None:
                    occupancy.append((len(pool.live), slots))
                self._step_all(pool, interrupts)
                pool.deliver_done()
        except Cancelled:
            pool.cancel()
        except interrupts as exc:
            pool.deliver_done()
            raise Interrupted(exc, []) from exc
        finally:  # the pool refers back to the decoder: kept, that cycle would wait for a full gc
            self.pool = None

    def _step_all(self, pool: SlotPool, interrupts: tuple[type[BaseException], ...]) -> None:
        """One decoder step over every live row (in slot order when `slot_order`: a full step then
        reads the arena as a slice), then the liveness guard: a row past its step budget errors."""
        live = pool.live
        if getattr(self.config, "slot_order", False):
            live = sorted(live, key=lambda s: s.slot)
        self._guarded(self.step, pool.live, live, interrupts + (Cancelled,))
        self.log.settle()
        self.note_emitted(pool.live)
        for s in pool.live:
            s.steps += 1
            if not s.done and s.steps > self.step_budget([s]):
                s.error, s.done = f"no progress after {s.steps} steps", True

    @staticmethod
    def _guarded(fn, seqs: list[Seq], arg, passthrough: tuple[type[BaseException], ...]) -> None:
        """One pass that serves every row of `seqs`: if it fails they fail together, with its error
        (the caller's interrupts and cancellation pass through)."""
        try:
            fn(arg)
        except passthrough:
            raise
        except torch.OutOfMemoryError:  # the device's limit, not the rows': the caller backs off
            raise
        except Exception as exc:  # noqa: BLE001 — one forward serves every row in it
            msg = f"{type(exc).__name__}: {exc}"
            for s in seqs:
                s.error, s.done = msg, True

    def need(self, req: DecodeRequest) -> int:
        """Arena entries one request can occupy: prompt, its canvases and the ones in flight."""
        in_flight = getattr(self.config, "max_canvases", 1)
        return len(req.prompt_ids) + (-(-req.max_tokens // self.C) + in_flight + 1) * self.C

    def capacity_for(self, requests) -> int:
        return max((self.need(r) for r in requests), default=0)

    def step_budget(self, seqs: list[Seq]) -> int:
        """Liveness guard: forced accept commits ≥ 1 token per step on the front canvas, so a row
        needs at most C forwards per canvas; anything beyond twice that is a bug."""
        return 2 * max(s.n_canvases for s in seqs) * self.C + 16

    def release_stream(self) -> None:
        """Drop what the last stream holds on the device (its arena, slots and rows), so a stream that
        follows an out-of-memory does not allocate beside it."""
        self.arena = self.pool = None
        self.last_seqs = []
        self._deferred = []

    # -- hooks ----------------------------------------------------------------------------------
    def new_stream(self, slots: int) -> None:
        """A stream starts over `slots` slots (the pool and arena are set): per-slot state goes here."""

    def new_arena(self, slots: int, capacity: int) -> KVArena:
        if self.graphs is not None:  # graphs read one arena for the life of the process
            arena = self.graphs.arena(slots, capacity)
            if arena is not None:
                return arena
        return self.rt.new_arena(slots=slots, capacity=capacity)

    def encode(self, items) -> None:
        """One encoder pass over (slot, ids, positions) items (through a CUDA graph when it can)."""
        if self.graphs is None:
            self.rt.encode_many(self.arena, items)
            return
        spare = self._spare_slots(
            {slot for slot, _, _ in items}, len(items), max(len(ids) for _, ids, _ in items)
        )
        if spare:  # padded to a bucket of windows on free slots, which are emptied again after: each
            # encodes the last item's rows again (no launch to make them; nothing reads what they write)
            _, ids, pos = items[-1]
            items = list(items) + [(slot, ids, pos) for slot in spare]
        self.graphs.encode_many(self.arena, items)
        for slot in spare:  # spare slots are the runner's arena's (`_spare_slots`)
            assert self.arena is not None
            self.arena.reset(slot)

    @property
    def folds(self) -> bool:
        """Whether encoder passes ride in the next decoder forward (`fold_encode`; see `prefill`)."""
        return bool(getattr(self.config, "fold_encode", False))

    def forward(self, windows, **kw):
        """One decoder forward over `windows` (through a CUDA graph when the runner can take it).

        Under continuous batching the number of live windows changes every few steps; a graph is
        captured per window count, so the windows are padded to a count bucket (`WINDOW_BUCKETS`)
        with windows on free slots that receive zero self-conditioning and whose logits are dropped."""
        if self.graphs is None or any(w.encoder_rows for w in windows):  # encoder rows: eager
            return self.rt.decode(self.arena, windows, **kw)
        spare = self._spare_slots({w.slot for w in windows}, len(windows), max(w.rows for w in windows))
        if not spare:
            return self.graphs.decode(self.arena, windows, **kw)
        last = windows[-1]
        off = None if last.self_cond is None else torch.zeros(last.rows, dtype=torch.bool, device=self.device)
        # the last window's rows again on each free slot, with no self-conditioning: nothing to launch
        # to make them, and their logits are dropped
        pad = [replace(last, slot=slot, capture=None, self_cond_rows=off, encoder_rows=0) for slot in spare]
        return self.graphs.decode(self.arena, list(windows) + pad, **kw).first(len(windows))

    def _spare_slots(self, used: set[int], count: int, rows: int) -> list[int]:
        """Free slots of the runner's arena that pad `count` windows of up to `rows` rows up to their
        bucket; none when the padded forward would run eagerly anyway (too many rows for a graph:
        the large forwards, FP8 among them), where padding is only extra work.

        Free means outside this pass (`used`) and held by no request of the stream (`pool.live`):
        an encoder pass carries only the rows that prefill or commit, and a padding window's slot is
        written and then emptied, which would erase the cache of a live row that sat out the pass."""
        if self.graphs is None or self.arena is not self.graphs.store:
            return []
        want = next((b for b in WINDOW_BUCKETS if b >= count), count)
        if not self.graphs.takes(want, rows):
            return []
        held = used | {s.slot for s in (self.pool.live if self.pool is not None else ())}
        return [s for s in range(self.arena.slots) if s not in held][: want - count]

    def prefill(self, seqs: list[Seq]) -> None:
        """Encode every prompt, and the canvases whose commit pass was deferred (`defer_encode`), in one
        pass; then spawn each new row's first canvas. When encoder passes fold into the decoder
        forward (`folds`), the commits and the prompts ride there instead (a long prompt as several
        causal query blocks of at most a canvas's rows), and no pass runs here."""
        items, rows, states = [], {}, {}
        for s in seqs:
            ids = to_device(s.req.prompt_ids, self.device)
            item = (s.slot, ids, torch.arange(s.prompt_len, device=self.device))
            if self.folds:
                self._deferred.append((s, item))
                continue
            items.append(item)
            rows[s.row], states[s.row] = s.prompt_len, "prefill"
        if not self.folds:
            deferred, self._deferred = [(s, it) for s, it in self._deferred if not s.done], []
            for s, item in deferred:
                items.append(item)
                rows[s.row], states[s.row] = len(item[1]), "commit"
        if items:
            with self.timed() as t:
                self.encode(items)
            self.record("encode", t, rows, {}, states)  # its time is read after the next step
        for s in seqs:
            self.spawn(s)

    def take_deferred(self, seqs: list[Seq]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The deferred encoder items of `seqs` (row -> ids, positions; a row's items in order), taken
        off the list; items of finished rows are dropped."""
        rows = {s.row for s in seqs}
        mine: dict[int, list] = {}
        for s, item in self._deferred:
            if not s.done and s.row in rows:
                mine.setdefault(s.row, []).append(item)
        self._deferred = [(s, it) for s, it in self._deferred if not s.done and s.row not in rows]
        return {
            r: (torch.cat([ids for _, ids, _ in its]), torch.cat([pos for _, _, pos in its]))
            for r, its in mine.items()
        }

    def defer_encode(self, s: Seq, item) -> None:
        """Leave a retired canvas's encoder pass (slot, ids, positions) to the next prefill pass, which
        the loop runs before the row's next decoder forward: one encoder pass per step, not two (each
        pass pays the weights' read and, at large batch, runs eagerly)."""
        self._deferred.append((s, item))

    def step(self, seqs: list[Seq]) -> None:
        raise NotImplementedError

    # -- a canvas ends whole ----------------------------------------------------------------------
    def answer_ends(self, s: Seq, toks: list[int]) -> str | None:
        """Whether the answer ends with the canvas just retired (`toks`, already in `s.out`): its finish
        reason, or None. EOS (or PAD) in it ends it; so do its last canvas and max_tokens."""
        if any(t in self.stop_ids for t in toks):
            return FinishReason.stop
        if s.spawned >= s.n_canvases or len(s.out) >= s.req.max_tokens:
            return FinishReason.length
        return None

    def retire_canvases(self, seqs: list[Seq], tokens: list[list[int]]) -> None:
        """Each row's front canvas ends with its final `tokens`: they join the answer and the canvas is
        retired; the answer ends (`answer_ends`), or the canvas is written to the cache
        (`encode_commits`) and the next one spawned (its x_T draw needs no model pass)."""
        for s, toks in zip(seqs, tokens):
            s.out.extend(toks)
        self.note_emitted(seqs)  # the canvas is final at its last decoder step, before its encoder pass
        encodes = []
        for s, toks in zip(seqs, tokens):
            cv = s.canvases.pop(0)
            cv.tokens = to_device(toks, self.device)
            cv.committed[:] = True
            s.retired.append(cv)
            ended = self.answer_ends(s, toks)
            if ended is not None:
                s.done, s.finish_reason = True, ended
                continue
            encodes.append((s, (s.slot, cv.tokens, torch.arange(cv.start, cv.end, device=self.device))))
        self.encode_commits(encodes)
        for s, _ in encodes:
            self.spawn(s)

    def encode_commits(self, encodes: list[tuple[Seq, tuple]]) -> None:
        """The encoder pass of retired rows, (row, (slot, ids, positions)) each: left to the next prefill
        pass (`defer_commits`) or to the next decoder forward (`folds`), else one pass now. Its time is
        read after the next step's sync (`record` gets the timer), so the host goes on queueing work
        while the pass runs."""
        if not encodes:
            return
        if getattr(self.config, "defer_commits", False) or self.folds:  # before the row's next step
            for s, item in encodes:
                self.defer_encode(s, item)
            return
        with self.timed() as t:
            self.encode([item for _, item in encodes])
        self.record(
            "encode",
            t,
            {s.row: int(item[1].numel()) for s, item in encodes},
            {},
            {s.row: "commit" for s, _ in encodes},
        )

    # -- shared helpers -------------------------------------------------------------------------
    def slot_index(self, seqs: list[Seq]) -> torch.Tensor:
        """[B] long on the device: the rows' slots, to gather and scatter per-slot state."""
        return to_device([s.slot for s in seqs], self.device)

    def generator(self, seed: int, custom_id: str) -> torch.Generator:
        """The request's RNG (a CPU one: its draws are moved to the device)."""
        return row_generator(seed, custom_id)

    def spawn(self, s: Seq) -> Canvas:
        """A new canvas of uniform-random tokens after the last one (the sampler's x_T ~ U(V))."""
        start = s.prompt_len + s.spawned * self.C
        V = self.rt.vocab_size
        toks = torch.randint(0, V, (self.C,), generator=s.gen, device=s.gen.device).to(self.device)
        state = "full" if not s.canvases else "draft"
        cv = Canvas(
            index=s.spawned,
            start=start,
            tokens=toks,
            committed=torch.zeros(self.C, dtype=torch.bool, device=self.device),
            state=state,
        )
        s.canvases.append(cv)
        s.spawned += 1
        s.stats["spawned"] += 1
        return cv

    def record(self, kind, ms: float | PassTimer, rows, commits, states) -> None:
        """One model pass, per request it carried (`PassLog.record`)."""
        self.log.record(kind, ms, rows, commits, states)

    def timed(self) -> PassTimer:
        return PassTimer(self.device)

    # -- latency marks ----------------------------------------------------------------------------
    def emitted(self, s: Seq) -> int:
        """Answer tokens that are final and form a prefix (what could be streamed now)."""
        return len(s.out)

    def note_emitted(self, seqs: list[Seq]) -> None:
        """Set each row's first-token / first-window pass marks the first time they are reached
        (decoders call it before a commit pass that follows the tokens' decision)."""
        for s in seqs:
            if "first_window_pass" in s.stats:
                continue
            n, k = self.emitted(s), len(self.log.of(s.row))
            if n >= 1:
                s.stats.setdefault("first_token_pass", k)
            if n >= self.C:
                s.stats["first_window_pass"] = k

    # -- results --------------------------------------------------------------------------------
    def _result(self, s: Seq) -> DecodeResult:
        self.log.settle()
        traces = self.log.of(s.row)
        for mark in ("first_token_pass", "first_window_pass"):  # ended shorter: its last pass
            s.stats.setdefault(mark, len(traces))
        tokens = s.out[: s.req.max_tokens] if s.error is None else []
        cut = first_stop(tokens, self.stop_ids) if s.error is None else None
        if cut is not None:
            tokens = tokens[:cut]
            s.finish_reason = FinishReason.stop
        return DecodeResult(
            custom_id=s.req.custom_id,
            token_ids=tokens,
            text=self.bundle.decode_text(tokens) if s.error is None else "",
            finish_reason=s.finish_reason
            if s.error is None
            else (s.finish_reason if s.error == CANCELLED else FinishReason.error),
            prompt_tokens=s.prompt_len,
            forwards=len(traces),
            traces=traces,
            error=s.error,
            decoder=self.name,
            stats=dict(s.stats),
        )
