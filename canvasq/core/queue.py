"""The queue protocol over SQL: what producers and workers do to runs, chunks and rows (create,
publish, claim under a lease, write results exactly once, close, retry, expire, reconcile).

Exactly-once outputs over at-least-once delivery: a result is written only while its request row is
still `queued` (a conditional UPDATE decides, inside the same transaction as the output upsert), so
a redelivered or duplicated chunk writes nothing new. Run and request rows are committed before any
chunk is published (outbox; `reconcile` publishes what a crash left unpublished).

What crosses rooms: `Job` (core.schemas) in, `ClaimedChunk` of `ClaimedRequest`s out to the worker,
`ResultRecord`s back from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import Table, delete, func, insert, select, update
from sqlalchemy.orm import Session

from canvasq.core.db import rowcount, transient, upsert
from canvasq.core.records import ClaimedChunk, ClaimedRequest, ClaimState, ResultRecord
from canvasq.core.runs import RunControl
from canvasq.core.statuses import ChunkStatus, RequestStatus, RunStatus
from canvasq.core.submission import Submission
from canvasq.core.tables import Chunk, ForwardTraceRow, Output, Request, Run, utcnow
from canvasq.core.workers import WorkerLiveness

# a claimed row's columns, in `ClaimedRequest`'s field order
CLAIMED_COLUMNS = (
    Request.custom_id,
    Request.prompt,
    Request.task,
    Request.max_tokens,
    Request.decoder,
    Request.response_format,
    Request.think,
)


def _not_a_delivery(s: Session, chunk: Chunk, run: Run, worker_id: str, now: datetime) -> ClaimedChunk | None:
    """A message that is not a delivery, so nothing is counted or changed: a finished chunk's duplicate
    (counted, enough of them would mark it failed; one that ended with rows left queued is a delivery
    as before), or the late message of a chunk another worker holds ahead (`claim_ahead`)."""
    if chunk.status == ChunkStatus.done and not s.scalar(
        select(Request.id)
        .where(Request.chunk_id == chunk.id, Request.status == RequestStatus.queued)
        .limit(1)
    ):
        return ClaimedChunk(ClaimState.empty, chunk.id, run.id, run.model, run.decoder, chunk.attempts)
    held = (
        chunk.claimed_ahead
        and chunk.status == ChunkStatus.running
        and chunk.worker_id != worker_id
        and chunk.lease_expires_at is not None
        and chunk.lease_expires_at > now
    )
    if held:
        return ClaimedChunk(ClaimState.busy, chunk.id, run.id, run.model, run.decoder, chunk.attempts)
    return None


class QueueStore(Submission, RunControl, WorkerLiveness):
    """The queue protocol: every write the producers and workers make, and the reads they decide on."""

    # -- worker side ------------------------------------------------------------------------------
    @transient
    def claim_chunk(self, chunk_id: str, worker_id: str, lease_s: int, max_attempts: int) -> ClaimedChunk:
        """Count this delivery (attempts in SQL: Celery does not cap redelivery, celery#9082) and
        return the chunk's unfinished rows. Past `max_attempts` the rows become errored/worker_lost.
        A finished chunk's duplicate, or the late message of a chunk another worker holds ahead, is
        not a delivery: nothing is counted or changed."""
        now = utcnow()
        with self.Session.begin() as s:
            row = s.execute(
                select(Chunk, Run)
                .join(Run, Run.id == Chunk.run_id)
                .where(Chunk.id == chunk_id)
                .with_for_update(of=Chunk)  # PostgreSQL: one claim (or claim_ahead) of a chunk at a time
            ).first()
            if row is None:
                return ClaimedChunk(ClaimState.missing, chunk_id)
            chunk, run = row
            skip = _not_a_delivery(s, chunk, run, worker_id, now)
            if skip is not None:
                return skip
            attempts = chunk.attempts + 1
            s.execute(
                update(Chunk)
                .where(Chunk.id == chunk_id)
                .values(
                    attempts=Chunk.attempts + 1,
                    status=ChunkStatus.running,
                    worker_id=worker_id,
                    lease_expires_at=now + timedelta(seconds=lease_s),
                    claimed_ahead=False,
                    updated_at=now,
                )
            )
            claimed = ClaimedChunk(ClaimState.work, chunk_id, run.id, run.model, run.decoder, attempts)
            if self._closes_on_claim(s, claimed, run.status, max_attempts, now):
                return claimed
            if run.status == RunStatus.queued:
                s.execute(
                    update(Run)
                    .where(Run.id == run.id, Run.status == RunStatus.queued)
                    .values(status=RunStatus.running, started_at=now, updated_at=now)
                )
            reqs = s.execute(
                select(*CLAIMED_COLUMNS)
                .where(Request.chunk_id == chunk_id, Request.status == RequestStatus.queued)
                .order_by(Request.line_no)
            ).all()
            claimed.requests = [ClaimedRequest(*r) for r in reqs]
            if not reqs:
                claimed.state = ClaimState.empty
            return claimed

    def _closes_on_claim(
        self, s: Session, claimed: ClaimedChunk, run_status: str, max_attempts: int, now: datetime
    ) -> bool:
        """A claimed chunk whose rows end at once: its run was cancelled or expired (rows closed with
        that status), or its deliveries passed `max_attempts` (rows errored `worker_lost`, the chunk
        failed). Sets `claimed.state` and returns True then."""
        chunk_id, run_id, attempts = claimed.chunk_id, claimed.run_id or "", claimed.attempts or 0
        if run_status in (RunStatus.cancelling, RunStatus.cancelled, RunStatus.expired):
            status = RequestStatus.expired if run_status == RunStatus.expired else RequestStatus.cancelled
            self._close_rows(s, chunk_id, run_id, status, status, f"run {run_status}")
            claimed.state = ClaimState.cancelled
            return True
        if attempts > max_attempts:
            why = f"chunk delivered {attempts} times without finishing (max_attempts={max_attempts})"
            self._close_rows(s, chunk_id, run_id, RequestStatus.errored, "worker_lost", why)
            s.execute(
                update(Chunk).where(Chunk.id == chunk_id).values(status=ChunkStatus.failed, updated_at=now)
            )
            claimed.state = ClaimState.exhausted
            return True
        return False

    @transient
    def max_queued_tokens(self, run_id: str) -> int:
        """The largest max_tokens among the run's queued rows (0 when none is queued)."""
        with self.Session() as s:
            return (
                s.scalar(
                    select(func.max(Request.max_tokens)).where(
                        Request.run_id == run_id, Request.status == RequestStatus.queued
                    )
                )
                or 0
            )

    @transient
    def claim_ahead(
        self, run_id: str, worker_id: str, lease_s: int, max_attempts: int, skip: Sequence[str] = ()
    ) -> ClaimedChunk | None:
        """Claim the run's next queued, published chunk (not in `skip`) from SQL before its message
        reaches anyone: a worker whose decode slots are running dry feeds its rows into the same
        stream. Counted as a delivery; the chunk's own message, when it comes, is dropped uncounted
        while this claim holds or once the chunk is done (`claim_chunk`). None when there is none."""
        now = utcnow()
        with self.Session.begin() as s:
            run = s.get(Run, run_id)
            if run is None or run.status not in (RunStatus.queued, RunStatus.running):
                return None
            chunk = s.execute(
                select(Chunk)
                .where(
                    Chunk.run_id == run_id,
                    Chunk.status == ChunkStatus.queued,
                    Chunk.published_at.is_not(None),
                    Chunk.attempts < max_attempts,
                    Chunk.id.not_in(list(skip)),
                )
                .order_by(Chunk.seq)
                .limit(1)
                .with_for_update(skip_locked=True)
            ).scalar_one_or_none()
            if chunk is None:
                return None
            cid, attempts = chunk.id, chunk.attempts + 1
            res = s.execute(
                update(Chunk)
                .where(Chunk.id == cid, Chunk.status == ChunkStatus.queued)
                .values(
                    attempts=Chunk.attempts + 1,
                    status=ChunkStatus.running,
                    worker_id=worker_id,
                    lease_expires_at=now + timedelta(seconds=lease_s),
                    claimed_ahead=True,
                    updated_at=now,
                )
            )
            if rowcount(res) != 1:  # claimed by another worker between the read and the write
                return None
            reqs = s.execute(
                select(*CLAIMED_COLUMNS)
                .where(Request.chunk_id == cid, Request.status == RequestStatus.queued)
                .order_by(Request.line_no)
            ).all()
            return ClaimedChunk(
                ClaimState.work if reqs else ClaimState.empty,
                cid,
                run_id,
                run.model,
                run.decoder,
                attempts,
                [ClaimedRequest(*r) for r in reqs],
            )

    @transient
    def release_ahead(self, chunk_id: str, worker_id: str) -> None:
        """Give back a chunk claimed ahead and not fed (its rows need another stream): queued again,
        that claim uncounted; its message, still in the broker, is then an ordinary delivery."""
        with self.Session.begin() as s:
            s.execute(
                update(Chunk)
                .where(
                    Chunk.id == chunk_id,
                    Chunk.worker_id == worker_id,
                    Chunk.status == ChunkStatus.running,
                    Chunk.claimed_ahead.is_(True),
                )
                .values(
                    status=ChunkStatus.queued,
                    attempts=Chunk.attempts - 1,
                    worker_id=None,
                    lease_expires_at=None,
                    claimed_ahead=False,
                    updated_at=utcnow(),
                )
            )

    @transient
    def close_chunk_rows(self, chunk_id: str, run_id: str, status: str, code: str, message: str) -> int:
        with self.Session.begin() as s:
            return self._close_rows(s, chunk_id, run_id, status, code, message)

    @transient
    def record_chunk_error(self, chunk_id: str, message: str) -> None:
        with self.Session.begin() as s:
            s.execute(
                update(Chunk)
                .where(Chunk.id == chunk_id)
                .values(last_error=message[:4000], updated_at=utcnow())
            )

    def _close_rows(
        self, s: Session, chunk_id: str, run_id: str, status: str, code: str, message: str
    ) -> int:
        """Unfinished rows of a chunk → terminal `status`, with an error output line each. Only the rows
        this UPDATE moves get one (RETURNING, as `write_results` claims its rows): a row a worker
        stores between a read of the queued rows and the update keeps its output (a select first
        let a concurrent `done` row get an `expired` output line: the reliability harness's T13)."""
        req = cast(Table, Request.__table__)
        now = utcnow()
        ids = list(
            s.scalars(
                update(req)
                .where(
                    req.c.run_id == run_id, req.c.chunk_id == chunk_id, req.c.status == RequestStatus.queued
                )
                .values(status=status, updated_at=now)
                .returning(req.c.custom_id)
            )
        )
        if not ids:
            return 0
        upsert(
            s,
            Output,
            [
                {
                    "run_id": run_id,
                    "custom_id": c,
                    "error_code": code,
                    "error_message": message,
                    "text": None,
                    "created_at": now,
                    "updated_at": now,
                }
                for c in ids
            ],
            ("run_id", "custom_id"),
            ("error_code", "error_message", "text", "updated_at"),
        )
        return len(ids)

    @transient
    def write_results(
        self, run_id: str, records: Sequence[ResultRecord], worker_id: str | None = None
    ) -> int:
        """Store results of requests still `queued`; returns how many were written (0 on a
        duplicate delivery). One transaction and a few statements for the whole batch (the rows of
        one decoder step): the requests' status (UPDATE ... RETURNING the rows still queued, so a
        redelivery or late duplicate writes nothing), the outputs' upsert, the traces."""
        first: dict[str, ResultRecord] = {}
        for r in records:
            first.setdefault(r.custom_id, r)  # a custom_id twice in one batch: the first one counts
        now = utcnow()
        written = 0
        rows = list(first.values())
        with self.Session.begin() as s:
            for i in range(0, len(rows), _IN_BATCH):
                written += self._write_batch(s, run_id, rows[i : i + _IN_BATCH], worker_id, now)
        return written

    @staticmethod
    def _write_batch(
        s: Session, run_id: str, records: list[ResultRecord], worker_id: str | None, now: datetime
    ) -> int:
        req = cast(Table, Request.__table__)
        claimed: set[str] = set()
        for status in {r.status for r in records}:
            ids = [r.custom_id for r in records if r.status == status]
            claimed.update(
                s.scalars(
                    update(req)
                    .where(
                        req.c.run_id == run_id,
                        req.c.custom_id.in_(ids),
                        req.c.status == RequestStatus.queued,
                    )
                    .values(status=status, updated_at=now)
                    .returning(req.c.custom_id)
                )
            )
        mine = [r for r in records if r.custom_id in claimed]  # the rest: already terminal
        if not mine:
            return 0
        vals = [
            {
                "run_id": run_id,
                "custom_id": r.custom_id,
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "forwards": r.forwards,
                "decoder": r.decoder,
                "gen_ms": r.gen_ms,
                "worker_id": worker_id,
                "error_code": r.error_code,
                "error_message": r.error_message,
                "reasoning": r.reasoning,
                "reasoning_tokens": r.reasoning_tokens,
                "created_at": now,
                "updated_at": now,
            }
            for r in mine
        ]
        upsert(
            s,
            Output,
            vals,
            ("run_id", "custom_id"),
            [k for k in vals[0] if k not in ("run_id", "custom_id", "created_at")],
        )
        s.execute(
            delete(ForwardTraceRow).where(
                ForwardTraceRow.run_id == run_id, ForwardTraceRow.custom_id.in_([r.custom_id for r in mine])
            )
        )
        traces = [dict(run_id=run_id, custom_id=r.custom_id, **t) for r in mine for t in r.traces]
        if traces:  # Core executemany (the ORM's bulk path costs more per row than SQLite does)
            s.execute(insert(cast(Table, ForwardTraceRow.__table__)), traces)
        return len(mine)

    @transient
    def finish_chunk(self, chunk_id: str) -> None:
        with self.Session.begin() as s:
            s.execute(
                update(Chunk).where(Chunk.id == chunk_id).values(status=ChunkStatus.done, updated_at=utcnow())
            )

    def run_status(self, run_id: str) -> str | None:
        with self.Session() as s:
            return s.scalar(select(Run.status).where(Run.id == run_id))

    @transient
    def finalize_run(self, run_id: str) -> str | None:
        """If no row is left queued: cancelling → cancelled, queued/running → completed."""
        now = utcnow()
        with self.Session.begin() as s:
            left = s.scalar(
                select(func.count()).where(Request.run_id == run_id, Request.status == RequestStatus.queued)
            )
            if left:
                return None
            s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == RunStatus.cancelling)
                .values(status=RunStatus.cancelled, finished_at=now, updated_at=now)
            )
            s.execute(
                update(Run)
                .where(
                    Run.id == run_id,
                    Run.status.in_((RunStatus.queued, RunStatus.running, RunStatus.interrupted)),
                )
                .values(status=RunStatus.completed, finished_at=now, updated_at=now)
            )
            return s.scalar(select(Run.status).where(Run.id == run_id))


_IN_BATCH = 500  # custom_ids per IN list (SQLite's and PostgreSQL's parameter limits stay far off)
