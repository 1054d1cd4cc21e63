"""Cross-chunk feeding: when fewer than a slot count of a chunk's rows are left to feed, the worker
claims the run's next chunk straight from SQL (`QueueStore.claim_ahead`) and feeds its rows into the
same decode stream, so the slots stay full across chunk boundaries instead of draining at each one.

Flow: feed(n) finds fewer than n + the stream's reserve rows left → `AheadFeeder.top_up` claims the next queued,
published chunk of the run (a counted delivery under this worker's lease, renewed by the heartbeat)
→ its rows, if they all take this stream's route and fit its arena (sized for the run's longest
max_tokens), join the stream; otherwise the chunk is released (queued again, uncounted) and the next
one is tried, up to MAX_RELEASED → each row is written as it ends, and a chunk whose rows are all
written is finished at once. The chunk's own
message, when a worker receives it, is dropped without counting while the claim holds or once the
chunk is done. A worker that dies holding chunks claimed ahead stops renewing their leases:
reconcile re-publishes them like any other (rows written before stay written).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from canvasq.core.records import ClaimState

if TYPE_CHECKING:
    from canvasq.decoders.types import DecodeRequest
    from canvasq.worker.engine import Engine

log = logging.getLogger(__name__)

MAX_RELEASED = 4  # chunks a stream may give back (other route, longer rows) before it stops looking


class AheadFeeder:
    """Claims and tracks the chunks one decode stream takes ahead of their messages."""

    def __init__(
        self, engine: Engine, run_id: str, route: tuple[str, dict], need, capacity: int, deadline: float
    ):
        self.engine, self.run_id, self.route = engine, run_id, route
        self.need, self.capacity, self.deadline = need, capacity, deadline
        self.pending: dict[str, set[str]] = {}  # chunk id -> custom_ids fed and not yet written
        self.chunk_of: dict[str, str] = {}  # custom_id -> its chunk id
        self.stopped = False
        self.claimed = 0
        self.released: list[str] = []  # given back: not claimed again by this stream

    def top_up(self, todo: list[DecodeRequest], want: int) -> None:
        """Claim chunks ahead until `want` more rows are in `todo` (or none is left to claim)."""
        engine, s = self.engine, self.engine.settings
        while want > 0 and not self.stopped:
            if time.monotonic() > self.deadline:  # leave the rest to their own deliveries
                self.stopped = True
                return
            claim = engine.store.claim_ahead(
                self.run_id, engine.worker_id, s.lease_s, s.max_attempts, self.released
            )
            if claim is None:
                self.stopped = True
                return
            if claim.state != ClaimState.work:  # every row already terminal
                engine.store.finish_chunk(claim.chunk_id)
                continue
            reqs = self._take(claim)
            if reqs is None:  # given back; a few in a row: the rest of the run is not for this stream
                self.stopped = len(self.released) >= MAX_RELEASED
                continue
            todo.extend(reqs)
            want -= len(reqs)

    def _take(self, claim) -> list[DecodeRequest] | None:
        """The claimed chunk's rows for this stream, or None (chunk released) if any row needs
        another route or more arena than the stream has."""
        engine, cid = self.engine, claim.chunk_id
        parts = [
            p for decoder, rows in engine.by_decoder(claim).items() for p in engine.routed(decoder, rows)
        ]
        if len(parts) != 1 or (parts[0][0], parts[0][1]) != self.route:
            self._release(cid, "rows for another decoder route")
            return None
        reqs, records = engine.tokenize(parts[0][2], self.route[0])
        if any(self.need(q) > self.capacity for q in reqs):
            self._release(cid, "rows longer than this stream's arena")
            return None
        engine.ahead_chunks.add(cid)  # renewed by the heartbeat from here on
        if records:  # rows the tokenizer refused: errored now
            engine.store.write_results(self.run_id, records, engine.worker_id)
        self.pending[cid] = {q.custom_id for q in reqs}
        for q in reqs:
            self.chunk_of[q.custom_id] = cid
        self.claimed += 1
        log.info("claimed chunk %s ahead (%d rows) into the running stream", cid, len(reqs))
        if not reqs:
            self._finish(cid)
        return reqs

    def _release(self, cid: str, why: str) -> None:
        log.info("chunk %s released, not fed ahead: %s", cid, why)
        self.released.append(cid)
        self.engine.store.release_ahead(cid, self.engine.worker_id)

    def written(self, custom_id: str) -> None:
        """A fed row was stored: finish its chunk once all of the chunk's rows are."""
        cid = self.chunk_of.pop(custom_id, None)
        if cid is None:
            return
        left = self.pending[cid]
        left.discard(custom_id)
        if not left:
            self._finish(cid)

    def _finish(self, cid: str) -> None:
        self.engine.store.finish_chunk(cid)
        self.pending.pop(cid, None)
        self.engine.ahead_chunks.discard(cid)

    def close(self, cancelled_status: str | None = None) -> None:
        """The stream ended. With `cancelled_status` (the run was cancelled or expired) the rows still
        queued in chunks claimed ahead are closed with it and those chunks finished; otherwise a
        chunk with rows left (an interrupted stream) keeps them queued and its lease lapses, so
        reconcile re-publishes it."""
        for cid in list(self.pending):
            if cancelled_status is not None:
                self.engine.store.close_chunk_rows(
                    cid, self.run_id, cancelled_status, cancelled_status, f"run {cancelled_status}"
                )
                self._finish(cid)
            else:
                self.engine.ahead_chunks.discard(cid)
