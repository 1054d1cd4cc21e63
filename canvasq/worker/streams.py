"""A claimed chunk's rows through a decoder and into the store: tokenise, decode (a continuous-batching
stream, or `run_batch` for the decoders without one), and write the rows that end in a step together at its end.

Flow: ClaimedRequest rows → `tokenize` (DecodeRequests; a row the tokenizer refuses is errored alone)
→ `stream_and_store` (the production path: `decode_slots` requests in flight, a free slot refilled at
once, the run's next chunks claimed ahead when the chunk's own rows are all in flight) or
`decode_and_store` (batches of `decode_batch_size` through `run_batch`) → `result_record` →
`QueueStore.write_results` (idempotent per custom_id: a crash loses no finished row).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from canvasq.core.records import ClaimedRequest, ResultRecord
from canvasq.core.statuses import RequestStatus
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    Interrupted,
)
from canvasq.worker import faults

if TYPE_CHECKING:
    from collections.abc import Callable

    from canvasq.worker.ahead import AheadFeeder
    from canvasq.worker.engine import ChunkSummary, Engine

log = logging.getLogger(__name__)


def longest_first(reqs: list) -> list:
    """Rows (anything with `max_tokens`) in the order a stream admits them: the largest first (stable). A row's
    forwards grow with its canvases, so a long row admitted last runs on alone while the other
    slots sit empty; started first, it overlaps the short ones (longest-processing-time order).
    Replayed from a real run's forwards per row (200 mixed rows cycled to 2,000, one stream):
    64 slots 83 -> 99 % busy, 369 -> 311 steps (BENCHMARKS.md, "Decode slots per chunk size")."""
    return sorted(reqs, key=lambda q: -q.max_tokens)


def result_record(res: DecodeResult, gen_ms: float, decoder: str) -> ResultRecord:
    if res.error == CANCELLED:
        status, code = RequestStatus.cancelled, "cancelled"
    elif res.error:
        status, code = RequestStatus.errored, res.error_code or "decode_error"
    else:
        status, code = RequestStatus.done, None
    # vars, not dataclasses.asdict (a deep copy: 10x slower, in the decode loop once per finished row)
    traces = [
        {k: v for k, v in vars(t).items() if k != "index"} | {"forward_index": t.index} for t in res.traces
    ]
    return ResultRecord(
        custom_id=res.custom_id,
        text=res.text if not res.error or res.error == CANCELLED else None,
        token_ids=list(res.token_ids) if res.token_ids else [],
        finish_reason=res.finish_reason,
        prompt_tokens=res.prompt_tokens,
        completion_tokens=len(res.token_ids or []) if not res.error else 0,
        forwards=res.forwards,
        decoder=res.decoder or decoder,
        gen_ms=gen_ms,
        error_code=code,
        error_message=res.error if res.error else None,
        status=status,
        traces=traces,
        reasoning=res.reasoning,
        reasoning_tokens=res.reasoning_tokens,
    )


def failed_record(q: DecodeRequest, exc: BaseException, decoder: str) -> ResultRecord:
    """A row a failed stream or batch never finished: errored with the failure, never retried."""
    res = DecodeResult(
        q.custom_id, [], "", FinishReason.error, len(q.prompt_ids), 0, error=f"{type(exc).__name__}: {exc}"
    )
    return result_record(res, 0.0, decoder)


def tokenize(
    engine: Engine, rows: list[ClaimedRequest], decoder: str
) -> tuple[list[DecodeRequest], list[ResultRecord]]:
    """DecodeRequests, and an errored record for each row the tokenizer fails on (that row only)."""
    bundle, reqs, records = engine.bundle, [], []
    for r in rows:
        if r.response_format is not None and decoder != "official":  # validation sends them to official
            msg = f"response_format is supported by the official decoder only, not {decoder!r}"
            records.append(_errored(r.custom_id, "unsupported_response_format", msg, decoder))
            continue
        try:
            ids = bundle.encode_prompt(r.prompt, r.task)
            reqs.append(
                DecodeRequest(r.custom_id, list(ids), r.max_tokens, r.task, r.response_format, r.think)
            )
        except engine.interrupts:
            raise
        except Exception as exc:  # noqa: BLE001 - a row the tokenizer refuses errors alone
            records.append(_errored(r.custom_id, "tokenizer_error", f"{type(exc).__name__}: {exc}", decoder))
    return reqs, records


def _errored(custom_id: str, code: str, message: str, decoder: str) -> ResultRecord:
    """A row that errors alone before decoding (never retried)."""
    return ResultRecord(
        custom_id, status=RequestStatus.errored, error_code=code, error_message=message, decoder=decoder
    )


def _write(engine: Engine, run_id: str, records: list[ResultRecord]) -> int:
    return engine.store.write_results(run_id, records, engine.worker_id) if records else 0


class _RowStream:
    """One decode stream's rows: those still to feed (longest first, topped up from chunks claimed
    ahead), those fed, and the finished rows written at the step they end in: the rows of one step
    in one store write (`flush`, before the next forward), not one write each.

    With a feeder, chunks are claimed ahead while fewer than `reserve` rows (the stream's slots) would
    be left after a feed, so longest-first picks from more than the last chunk's leftovers: at 64
    slots and 128-row chunks, topping up only when the rows ran out left the slots 86 % full against
    90 % for the same rows in one chunk (H200, BENCHMARKS.md "Service throughput")."""

    def __init__(
        self,
        engine: Engine,
        run_id: str,
        decoder: str,
        reqs: list[DecodeRequest],
        should_stop: Callable[[], bool],
        feeder: AheadFeeder | None = None,
        reserve: int = 0,
    ):
        self.engine, self.run_id, self.decoder = engine, run_id, decoder
        self.reserve = reserve
        self.should_stop, self.feeder = should_stop, feeder
        self.todo, self.written = longest_first(reqs), 0
        self.fed: list[DecodeRequest] = []
        self.pending: list[tuple[str, ResultRecord]] = []  # finished this step, not yet written
        self.ended: set[str] = set()  # rows handed over (written or pending)

    def feed(self, n: int) -> list[tuple[str, DecodeRequest]]:
        todo = self.todo
        if self.feeder is not None and len(todo) < n + self.reserve and not self.should_stop():
            self.feeder.top_up(todo, n + self.reserve - len(todo))
            todo[:] = longest_first(todo)
        taken, todo[:] = todo[:n], todo[n:]
        self.fed.extend(taken)
        if taken:
            faults.before_decode(q.custom_id for q in taken)  # inert unless CANVASQ_TEST_* is set
        return [(q.custom_id, q) for q in taken]

    def on_result(self, key, res: DecodeResult) -> None:
        # its share of each pass that carried it (rows in flight share the wall; a sum over rows
        # of their time in flight would count it once per slot)
        ms = sum(t.ms * (t.own_rows or 0) / t.rows for t in res.traces if t.rows)
        self.pending.append((str(key), result_record(res, ms, self.decoder)))
        self.ended.add(str(key))

    def refeed(self) -> int:
        """After the stream ran out of device memory: the rows that ended are written, the rows in
        flight go back to be fed again from their first canvas (each row draws from its own
        generator, so its tokens are the same). Returns how many went back."""
        self.flush()
        back = [q for q in self.fed if q.custom_id not in self.ended]
        self.fed = [q for q in self.fed if q.custom_id in self.ended]
        self.todo[:] = longest_first(back + self.todo)
        return len(back)

    def flush(self) -> None:
        """The rows finished since the last flush, in one write (idempotent per custom_id)."""
        done, self.pending = self.pending, []
        if not done:
            return
        self.written += _write(self.engine, self.run_id, [rec for _, rec in done])
        if self.feeder is not None:
            for key, _ in done:
                self.feeder.written(key)
        on_row = self.engine.on_row  # last: `canvasq run`'s raises a noted Ctrl-C, after the bookkeeping
        if on_row is not None:
            for _ in done:
                on_row()

    def fail(self, exc: BaseException) -> None:
        """The stream failed: the rows finished before it are written as they ended; every other row
        not yet stored errors (stored ones are skipped by the store), the chunk's own and any claimed
        ahead, fed or not."""
        self.flush()
        left = [*self.fed, *self.todo]
        self.written += _write(self.engine, self.run_id, [failed_record(q, exc, self.decoder) for q in left])
        if self.feeder is not None:
            for q in left:
                self.feeder.written(q.custom_id)


def _ahead(
    engine: Engine, run_id: str, route: tuple[str, dict], dec, reqs: list[DecodeRequest], deadline: float
) -> tuple[int, AheadFeeder]:
    """(arena entries per slot, AheadFeeder) for a stream that takes the run's next chunks: an arena
    for the run's rows, not this chunk's (its longest max_tokens, prompts up to 1.5x this chunk's
    longest: a longer row's chunk is given back to its own delivery)."""
    from canvasq.worker.ahead import AheadFeeder

    prompt = max(len(q.prompt_ids) for q in reqs) * 3 // 2
    run_max = engine.store.max_queued_tokens(run_id)
    longest = DecodeRequest("", [0] * prompt, max(run_max, *(q.max_tokens for q in reqs)))
    capacity = max(dec.capacity_for(reqs), dec.need(longest))
    return capacity, AheadFeeder(engine, run_id, route, dec.need, capacity, deadline)


def stream_and_store(
    engine: Engine,
    run_id: str,
    decoder: str,
    knobs: dict,
    rows: list[ClaimedRequest],
    should_stop: Callable[[], bool],
    summary: ChunkSummary,
    ahead_until: float | None = None,
    feeders: list[AheadFeeder] | None = None,
) -> int:
    """Continuous batching over `rows`: `decode_slots` requests in flight, a free slot refilled at
    once, the rows that end in a step written to the store together at its end. With `ahead_until` (a monotonic
    time), once fewer than a slot count of `rows` are left to feed the run's next chunks are claimed
    ahead into the same stream
    (`worker.ahead`). Returns the rows written."""
    from canvasq.decoders.registry import make_decoder

    bundle = engine.bundle  # a load failure raises here: the chunk is retried, rows stay queued
    reqs, records = tokenize(engine, rows, decoder)
    written = _write(engine, run_id, records)
    if not reqs:
        return written
    s = engine.settings
    dec = make_decoder(
        decoder, bundle, knobs, s.cuda_graphs, engine.experts, fp8=s.fp8, fp8_min_rows=s.fp8_min_rows
    )
    capacity, feeder = dec.capacity_for(reqs), None
    if ahead_until is not None:
        capacity, feeder = _ahead(engine, run_id, (decoder, knobs), dec, reqs, ahead_until)
        if feeders is not None:
            feeders.append(feeder)
    stream = _RowStream(engine, run_id, decoder, reqs, should_stop, feeder, reserve=engine.decode_slots)
    occupancy: list[tuple[int, int]] = []
    try:
        _decode_stream(engine, dec, stream, capacity, occupancy)
    except Interrupted as cut:  # finished rows are already stored; the task abandons the rest
        raise cut.cause from None
    except engine.interrupts:
        raise
    except Exception as exc:  # deterministic failure → the rows not yet stored error, never a retry storm
        log.exception("decode stream failed for run %s", run_id)
        stream.fail(exc)
    finally:  # the decoder and its slot pool refer to each other: free the arena now, not at a gc
        dec.release_stream()
    _note_occupancy(summary, decoder, len(reqs), occupancy)
    return written + stream.written


def _decode_stream(engine: Engine, dec, stream: _RowStream, capacity: int, occupancy: list) -> None:
    """`dec.stream` over the stream's rows with the engine's slots; out of device memory, again with
    half as many (`_back_off`) until one slot."""
    import torch

    while True:
        slots = engine.decode_slots
        try:
            dec.stream(
                stream.feed,
                stream.on_result,
                slots=slots,
                seed=engine.settings.seed,
                capacity=capacity,
                should_stop=stream.should_stop,
                interrupts=engine.interrupts,
                occupancy=occupancy,
                flush=stream.flush,
            )
            return
        except torch.OutOfMemoryError:
            if slots <= 1:
                raise
        # out of device memory (outside the handler: its traceback holds the step's tensors)
        _back_off(engine, dec, stream, slots)


def _back_off(engine: Engine, dec, stream: _RowStream, slots: int) -> None:
    """A stream ran out of device memory at `slots`: the rows that ended are stored, the rows in
    flight go back to be fed, the decoder drops its arena and the engine halves its slots for good."""
    import gc

    import torch

    back = stream.refeed()
    dec.release_stream()
    if getattr(dec, "graphs", None) is not None:  # the graph runner's arena outlives streams: not this one
        dec.graphs.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    now = engine.shrink_slots(slots)
    log.warning(
        "decode stream of run %s: %d rows in flight fed again with %d slots", stream.run_id, back, now
    )


def _note_occupancy(summary: ChunkSummary, decoder: str, rows: int, occupancy: list[tuple[int, int]]) -> None:
    """The stream's (live rows, slots) per decoder step into the chunk's summary, and one log line."""
    if not occupancy:
        return
    summary.occupancy.extend(occupancy)
    full = 100 * sum(n for n, _ in occupancy) / sum(n for _, n in occupancy)
    log.info("decode stream %s: %d rows, %d steps, slots %.0f%% full", decoder, rows, len(occupancy), full)


def decode_and_store(
    engine: Engine, run_id: str, decoder: str, rows: list[ClaimedRequest], should_stop: Callable[[], bool]
) -> int:
    """`rows` through `run_batch` as one batch (the `hf` reference and an injected decode function);
    returns the rows written."""
    bundle = engine.bundle  # a load failure raises here: the chunk is retried, rows stay queued
    reqs, records = tokenize(engine, rows, decoder)
    if reqs:
        s, t0 = engine.settings, time.perf_counter()
        try:
            faults.before_decode(q.custom_id for q in reqs)  # inert unless CANVASQ_TEST_* is set
            results = engine.decode_fn(
                bundle,
                DecodeBatch(reqs, seed=s.seed),
                decoder,
                should_stop=should_stop,
                routing=s.routing or None,
                interrupts=engine.interrupts,
                cuda_graphs=s.cuda_graphs,
                experts=engine.experts,
                fp8=s.fp8,
                fp8_min_rows=s.fp8_min_rows,
            )
        except Interrupted as cut:  # keep the finished rows; the task abandons the rest of the chunk
            share = (time.perf_counter() - t0) * 1000 / len(reqs)
            _write(engine, run_id, records + [result_record(res, share, decoder) for res in cut.done])
            raise cut.cause from None
        except engine.interrupts:
            raise
        except Exception as exc:  # deterministic per-batch failure → errored rows, never a retry storm
            log.exception("decode failed for %d rows of run %s", len(reqs), run_id)
            return _write(engine, run_id, records + [failed_record(q, exc, decoder) for q in reqs])
        share = (time.perf_counter() - t0) * 1000 / len(reqs)
        records += [result_record(res, share, decoder) for res in results]
    return _write(engine, run_id, records)
