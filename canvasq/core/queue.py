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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import cast

from sqlalchemy import Table, and_, case, delete, func, insert, or_, select, update
from sqlalchemy.orm import Session

from canvasq.core.db import StoreBase, new_run_id, rowcount, upsert
from canvasq.core.schemas import Job
from canvasq.core.statuses import RUN_ACTIVE, ChunkStatus, RequestStatus, RunStatus
from canvasq.core.tables import (
    Chunk,
    ForwardTraceRow,
    Output,
    Request,
    Run,
    Worker,
    utcnow,
)

# ---------------------------------------------------------------------------------------- records


@dataclass
class ResultRecord:
    """What the worker hands to the store for one request (from a DecodeResult)."""

    custom_id: str
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forwards: int = 0
    decoder: str | None = None
    gen_ms: float = 0.0
    error_code: str | None = None
    error_message: str | None = None
    status: RequestStatus = RequestStatus.done  # done | errored | cancelled
    traces: list[dict] = field(
        default_factory=list
    )  # forward_index, rows, commits, canvases, states, ms, kind


@dataclass
class RunCreated:
    run_id: str
    created: bool  # False: the idempotency key matched an existing run
    chunk_ids: list[str]
    requests: int


class ClaimState(StrEnum):
    """What a claim found. Only `work` leaves rows for the worker to decode."""

    work = "work"  # rows to do
    empty = "empty"  # every row already terminal: a redelivery
    exhausted = "exhausted"  # delivered more than max_attempts times: its rows were closed worker_lost
    cancelled = "cancelled"  # the run is cancelling, cancelled or expired: its rows were closed so
    missing = "missing"  # no such chunk
    busy = "busy"  # claimed ahead by a live worker that is decoding it: this delivery is dropped


@dataclass(frozen=True)
class ClaimedRequest:
    """One queued row of a claimed chunk: what the worker decodes (`decoder` None: the run's)."""

    custom_id: str
    prompt: str
    task: str | None
    max_tokens: int
    decoder: str | None


@dataclass
class ClaimedChunk:
    """A chunk claimed for work: its state and, in state `work`, its queued rows in input order."""

    state: ClaimState
    chunk_id: str
    run_id: str | None = None
    model: str | None = None
    run_decoder: str | None = None
    attempts: int = 0
    requests: list[ClaimedRequest] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- queue


class QueueStore(StoreBase):
    """The queue protocol: every write the producers and workers make, and the reads they decide on."""

    # -- submission -------------------------------------------------------------------------------
    def create_run(
        self,
        jobs: Iterable[Job],
        *,
        model: str,
        queue: str,
        decoder: str = "auto",
        chunk_size: int = 16,
        name: str | None = None,
        idempotency_key: str | None = None,
        input_path: str | None = None,
        input_sha256: str | None = None,
        mode: str = "queue",
        deadline_s: int | None = None,
        batch_rows: int = 1000,
        replace_key: bool = False,
    ) -> RunCreated:
        """Insert the run, its chunks and its requests in one transaction (streamed in batches).
        `replace_key`: a new run takes the key from the run that held it (`canvasq run --fresh`)."""
        with self.Session.begin() as s:
            if idempotency_key and replace_key:
                s.execute(
                    update(Run).where(Run.idempotency_key == idempotency_key).values(idempotency_key=None)
                )
            if idempotency_key:
                existing = s.scalar(select(Run).where(Run.idempotency_key == idempotency_key))
                if existing is not None:
                    existing_chunks = list(s.scalars(select(Chunk.id).where(Chunk.run_id == existing.id)))
                    n = s.scalar(select(func.count()).where(Request.run_id == existing.id))
                    return RunCreated(existing.id, False, existing_chunks, n or 0)
            run_id = new_run_id()
            now = utcnow()
            s.add(
                Run(
                    id=run_id,
                    name=name,
                    idempotency_key=idempotency_key,
                    model=model,
                    queue=queue,
                    decoder=decoder,
                    chunk_size=chunk_size,
                    status=RunStatus.queued,
                    mode=mode,
                    input_path=input_path,
                    input_sha256=input_sha256,
                    created_at=now,
                    updated_at=now,
                    deadline_at=now + timedelta(seconds=deadline_s) if deadline_s else None,
                )
            )
            s.flush()
            chunk_ids: list[str] = []
            chunks: list[dict] = []  # chunk rows not yet inserted
            buf: list[dict] = []

            def flush() -> None:  # one executemany per table; chunks first, the requests point at them
                for table, rows in ((Chunk, chunks), (Request, buf)):
                    if rows:
                        s.execute(insert(table), rows)
                        rows.clear()

            n = 0
            for job in jobs:
                seq = n // chunk_size
                if seq == len(chunk_ids):
                    chunk_ids.append(f"{run_id}-{seq:05d}")
                    chunks.append(
                        {
                            "id": chunk_ids[seq],
                            "run_id": run_id,
                            "seq": seq,
                            "status": ChunkStatus.queued,
                            "attempts": 0,
                            "updated_at": now,
                        }
                    )
                buf.append(
                    {
                        "run_id": run_id,
                        "custom_id": job.custom_id,
                        "line_no": job.line_no,
                        "prompt": job.prompt,
                        "task": job.task,
                        "max_tokens": job.max_tokens,
                        "decoder": job.decoder,
                        "stop": list(job.stop) or None,
                        "chunk_id": chunk_ids[seq],
                        "status": RequestStatus.queued,
                        "updated_at": now,
                    }
                )
                n += 1
                if len(buf) >= batch_rows:
                    flush()
            flush()
            if n == 0:
                raise ValueError("a run needs at least one request")
        return RunCreated(run_id, True, chunk_ids, n)

    def mark_published(self, chunk_ids: Sequence[str]) -> None:
        if not chunk_ids:
            return
        with self.Session.begin() as s:
            s.execute(update(Chunk).where(Chunk.id.in_(list(chunk_ids))).values(published_at=utcnow()))

    def unpublished_chunks(
        self, run_id: str | None = None, older_than: datetime | None = None
    ) -> list[tuple[str, str]]:
        """(chunk_id, queue) of queued chunks never published (outbox leftovers), of one run or all;
        with `older_than`, only chunks stored (or re-queued) before then, so a pass does not publish
        what a submit is publishing right now."""
        with self.Session() as s:
            q = (
                select(Chunk.id, Run.queue)
                .join(Run, Run.id == Chunk.run_id)
                .where(Chunk.status == ChunkStatus.queued, Chunk.published_at.is_(None))
            )
            if run_id is not None:
                q = q.where(Chunk.run_id == run_id)
            if older_than is not None:
                q = q.where(Chunk.updated_at < older_than)
            return [(r[0], r[1]) for r in s.execute(q.order_by(Chunk.id))]

    # -- worker side ------------------------------------------------------------------------------
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
            if chunk.status == ChunkStatus.done and not s.scalar(
                select(Request.id)
                .where(Request.chunk_id == chunk_id, Request.status == RequestStatus.queued)
                .limit(1)
            ):
                # a duplicate of a finished chunk: nothing to count or reopen (counted, enough of them
                # would mark it failed); one that ended with rows left queued is a delivery as before
                return ClaimedChunk(
                    ClaimState.empty, chunk_id, run.id, run.model, run.decoder, chunk.attempts
                )
            if chunk.claimed_ahead:  # its message arrives after a worker took it ahead (`claim_ahead`)
                held = (
                    chunk.status == ChunkStatus.running
                    and chunk.worker_id != worker_id
                    and chunk.lease_expires_at is not None
                    and chunk.lease_expires_at > now
                )
                if held:  # not a delivery: nothing counted
                    return ClaimedChunk(
                        ClaimState.busy, chunk_id, run.id, run.model, run.decoder, chunk.attempts
                    )
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
            if run.status in (RunStatus.cancelling, RunStatus.cancelled, RunStatus.expired):
                status = RequestStatus.expired if run.status == RunStatus.expired else RequestStatus.cancelled
                self._close_rows(s, chunk_id, run.id, status, status, f"run {run.status}")
                claimed.state = ClaimState.cancelled
                return claimed
            if attempts > max_attempts:
                self._close_rows(
                    s,
                    chunk_id,
                    run.id,
                    RequestStatus.errored,
                    "worker_lost",
                    f"chunk delivered {attempts} times without finishing (max_attempts={max_attempts})",
                )
                s.execute(
                    update(Chunk)
                    .where(Chunk.id == chunk_id)
                    .values(status=ChunkStatus.failed, updated_at=now)
                )
                claimed.state = ClaimState.exhausted
                return claimed
            if run.status == RunStatus.queued:
                s.execute(
                    update(Run)
                    .where(Run.id == run.id, Run.status == RunStatus.queued)
                    .values(status=RunStatus.running, started_at=now, updated_at=now)
                )
            reqs = s.execute(
                select(Request.custom_id, Request.prompt, Request.task, Request.max_tokens, Request.decoder)
                .where(Request.chunk_id == chunk_id, Request.status == RequestStatus.queued)
                .order_by(Request.line_no)
            ).all()
            claimed.requests = [ClaimedRequest(*r) for r in reqs]
            if not reqs:
                claimed.state = ClaimState.empty
            return claimed

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
                select(Request.custom_id, Request.prompt, Request.task, Request.max_tokens, Request.decoder)
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

    def close_chunk_rows(self, chunk_id: str, run_id: str, status: str, code: str, message: str) -> int:
        with self.Session.begin() as s:
            return self._close_rows(s, chunk_id, run_id, status, code, message)

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
        """Unfinished rows of a chunk → terminal `status`, with an error output line each."""
        ids = list(
            s.scalars(
                select(Request.custom_id).where(
                    Request.chunk_id == chunk_id, Request.status == RequestStatus.queued
                )
            )
        )
        if not ids:
            return 0
        now = utcnow()
        s.execute(
            update(Request)
            .where(
                Request.run_id == run_id, Request.custom_id.in_(ids), Request.status == RequestStatus.queued
            )
            .values(status=status, updated_at=now)
        )
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

    def write_results(
        self, run_id: str, records: Sequence[ResultRecord], worker_id: str | None = None
    ) -> int:
        """Store results of requests still `queued`; returns how many were written (0 on a
        duplicate delivery). One transaction: request status, output upsert, traces."""
        written = 0
        now = utcnow()
        with self.Session.begin() as s:
            for r in records:
                res = s.execute(
                    update(Request)
                    .where(
                        Request.run_id == run_id,
                        Request.custom_id == r.custom_id,
                        Request.status == RequestStatus.queued,
                    )
                    .values(status=r.status, updated_at=now)
                )
                if rowcount(res) != 1:
                    continue  # already terminal: a redelivery or a late duplicate
                written += 1
                vals = {
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
                    "created_at": now,
                    "updated_at": now,
                }
                upsert(
                    s,
                    Output,
                    [vals],
                    ("run_id", "custom_id"),
                    [k for k in vals if k not in ("run_id", "custom_id", "created_at")],
                )
                s.execute(
                    delete(ForwardTraceRow).where(
                        ForwardTraceRow.run_id == run_id, ForwardTraceRow.custom_id == r.custom_id
                    )
                )
                if r.traces:  # Core executemany (the ORM's bulk path costs more per row than SQLite does)
                    s.execute(
                        insert(cast(Table, ForwardTraceRow.__table__)),
                        [dict(run_id=run_id, custom_id=r.custom_id, **t) for t in r.traces],
                    )
        return written

    def finish_chunk(self, chunk_id: str) -> None:
        with self.Session.begin() as s:
            s.execute(
                update(Chunk).where(Chunk.id == chunk_id).values(status=ChunkStatus.done, updated_at=utcnow())
            )

    def run_status(self, run_id: str) -> str | None:
        with self.Session() as s:
            return s.scalar(select(Run.status).where(Run.id == run_id))

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

    def register_worker(
        self, worker_id: str, host: str, pid: int, device: str, model: str, queue: str | None
    ) -> None:
        now = utcnow()
        with self.Session.begin() as s:
            upsert(
                s,
                Worker,
                [
                    {
                        "id": worker_id,
                        "host": host,
                        "pid": pid,
                        "device": device,
                        "model": model,
                        "queue": queue,
                        "started_at": now,
                        "heartbeat_at": now,
                    }
                ],
                ("id",),
                ("host", "pid", "device", "model", "queue", "heartbeat_at"),
            )

    def heartbeat(
        self, worker_id: str, chunk_id: str | Sequence[str] | None = None, lease_s: float | None = None
    ) -> bool:
        """The worker is alive; while it works on `chunk_id` (one id, or several: chunks claimed
        ahead) their leases move to now + lease_s. Only a chunk still `running` under this worker is
        renewed (one re-published and claimed by another worker is that worker's). Returns whether
        every lease was renewed."""
        now = utcnow()
        ids = [chunk_id] if isinstance(chunk_id, str) else list(chunk_id or ())
        with self.Session.begin() as s:
            s.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=now))
            if not ids or lease_s is None:
                return False
            res = s.execute(
                update(Chunk)
                .where(Chunk.id.in_(ids), Chunk.worker_id == worker_id, Chunk.status == ChunkStatus.running)
                .values(lease_expires_at=now + timedelta(seconds=lease_s))
            )
            return rowcount(res) == len(ids)

    # -- embedded runs ----------------------------------------------------------------------------
    def run_by_key(self, idempotency_key: str) -> str | None:
        with self.Session() as s:
            return s.scalar(select(Run.id).where(Run.idempotency_key == idempotency_key))

    def pending_chunks(self, run_id: str) -> list[str]:
        """Chunks that still hold `queued` rows, in order: what a resumed embedded run has left to do
        (a chunk cut short by an interrupt is among them, whatever its own status says)."""
        with self.Session() as s:
            return list(
                s.scalars(
                    select(Chunk.id)
                    .where(
                        Chunk.run_id == run_id,
                        Chunk.id.in_(
                            select(Request.chunk_id).where(
                                Request.run_id == run_id, Request.status == RequestStatus.queued
                            )
                        ),
                    )
                    .order_by(Chunk.seq)
                )
            )

    def embedded_owner(self, run_id: str) -> Worker | None:
        """The process that last generated an embedded run (registered with queue `embedded:<run>`)."""
        with self.Session() as s:
            return s.scalar(
                select(Worker)
                .where(Worker.queue == f"embedded:{run_id}")
                .order_by(Worker.started_at.desc())
                .limit(1)
            )

    def active_embedded_runs(self) -> list[str]:
        with self.Session() as s:
            return list(s.scalars(select(Run.id).where(Run.mode == "embedded", Run.status.in_(RUN_ACTIVE))))

    def mark_interrupted(self, run_id: str, release_chunks: bool = False) -> None:
        """An embedded run whose process stopped before the end: `interrupted` (rerunning the same
        `canvasq run` resumes it). A cancel in progress stays `cancelling`. `release_chunks` (a clean
        stop, Ctrl-C): its running chunks go back to queued and that delivery is not counted against
        `max_attempts`, which is there for chunks that kill their process."""
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_((RunStatus.queued, RunStatus.running)))
                .values(status=RunStatus.interrupted, updated_at=now)
            )
            if release_chunks:
                s.execute(
                    update(Chunk)
                    .where(Chunk.run_id == run_id, Chunk.status == ChunkStatus.running)
                    .values(
                        status=ChunkStatus.queued,
                        attempts=func.max(Chunk.attempts - 1, 0)
                        if self.dialect == "sqlite"
                        else func.greatest(Chunk.attempts - 1, 0),
                        lease_expires_at=None,
                        updated_at=now,
                    )
                )

    def resume_run(self, run_id: str) -> None:
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(
                update(Run)
                .where(
                    Run.id == run_id,
                    Run.status.in_((RunStatus.queued, RunStatus.running, RunStatus.interrupted)),
                )
                .values(
                    status=RunStatus.running,
                    finished_at=None,
                    updated_at=now,
                    started_at=func.coalesce(Run.started_at, now),
                )
            )

    # -- control ----------------------------------------------------------------------------------
    def cancel_run(self, run_id: str, close_running: bool = False) -> str | None:
        """Flag the run `cancelling`; rows of chunks no worker holds are cancelled now. Running
        chunks see the flag between decoder steps. `close_running`: no process holds any chunk (an
        interrupted embedded run), so the rows of `running` chunks are cancelled now too."""
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_((*RUN_ACTIVE, RunStatus.interrupted)))
                .values(status=RunStatus.cancelling, updated_at=now)
            )
            q = select(Chunk.id).where(Chunk.run_id == run_id)
            if not close_running:
                q = q.where(Chunk.status == ChunkStatus.queued)
            for cid in s.scalars(q):
                self._close_rows(s, cid, run_id, RequestStatus.cancelled, "cancelled", "run cancelled")
        self.finalize_run(run_id)
        return self.run_status(run_id)

    def stuck_rows(self, run_id: str, offline_before: datetime, s: Session | None = None) -> list[str]:
        """Queued rows of a run that no live worker will finish: their chunk is `running` under a lease
        that expired or a worker whose last heartbeat is before `offline_before`, or it ended
        (done / failed) with the rows left queued, or it was never published. Rows of chunks that a
        live worker holds or that wait in the broker's queue are not stuck."""
        held_by_dead = and_(
            Chunk.status == ChunkStatus.running,
            or_(
                Chunk.lease_expires_at.is_(None),
                Chunk.lease_expires_at < utcnow(),
                Worker.id.is_(None),
                Worker.heartbeat_at < offline_before,
            ),
        )
        q = (
            select(Request.custom_id)
            .outerjoin(Chunk, Chunk.id == Request.chunk_id)
            .outerjoin(Worker, Worker.id == Chunk.worker_id)
            .where(
                Request.run_id == run_id,
                Request.status == RequestStatus.queued,
                or_(
                    Chunk.id.is_(None),
                    held_by_dead,
                    Chunk.status.in_((ChunkStatus.done, ChunkStatus.failed)),
                    and_(Chunk.status == ChunkStatus.queued, Chunk.published_at.is_(None)),
                ),
            )
            .order_by(Request.line_no)
        )
        if s is not None:
            return list(s.scalars(q))
        with self.Session() as s2:
            return list(s2.scalars(q))

    def retry_run(
        self, run_id: str, only: Sequence[str], chunk_size: int, offline_before: datetime | None = None
    ) -> list[str]:
        """Re-queue rows whose status is in `only` into new chunks; returns the new chunk ids.
        `stuck` in `only` (with `offline_before`) adds the queued rows `stuck_rows` finds."""
        now = utcnow()
        with self.Session.begin() as s:
            ids = list(
                s.scalars(
                    select(Request.custom_id)
                    .where(Request.run_id == run_id, Request.status.in_(list(only)))
                    .order_by(Request.line_no)
                )
            )
            if "stuck" in only and offline_before is not None:
                ids += self.stuck_rows(run_id, offline_before, s)
            if not ids:
                return []
            old_chunks = set(
                s.scalars(
                    select(Request.chunk_id).where(Request.run_id == run_id, Request.custom_id.in_(ids))
                )
            )
            base = (s.scalar(select(func.max(Chunk.seq)).where(Chunk.run_id == run_id)) or 0) + 1
            chunk_ids = []
            for i in range(0, len(ids), chunk_size):
                seq = base + i // chunk_size
                cid = f"{run_id}-{seq:05d}"
                s.execute(
                    insert(Chunk).values(
                        id=cid, run_id=run_id, seq=seq, status=ChunkStatus.queued, attempts=0, updated_at=now
                    )
                )
                s.execute(
                    update(Request)
                    .where(Request.run_id == run_id, Request.custom_id.in_(ids[i : i + chunk_size]))
                    .values(status=RequestStatus.queued, chunk_id=cid, updated_at=now)
                )
                chunk_ids.append(cid)
            # a stuck chunk whose rows all moved is over: neither reconcile nor its dead owner's
            # late renewal has anything left in it
            s.execute(
                update(Chunk)
                .where(
                    Chunk.id.in_([c for c in old_chunks if c]),
                    Chunk.status.in_((ChunkStatus.queued, ChunkStatus.running)),
                    ~select(Request.id)
                    .where(Request.chunk_id == Chunk.id, Request.status == RequestStatus.queued)
                    .exists(),
                )
                .values(
                    status=ChunkStatus.done,
                    lease_expires_at=None,
                    published_at=func.coalesce(Chunk.published_at, now),
                    updated_at=now,
                )
            )
            run = s.get(Run, run_id)
            # A retry gets a fresh deadline of the original length; the old, passed one would make the
            # next reconcile pass expire the retried rows again at once.
            deadline = now + (run.deadline_at - run.created_at) if run and run.deadline_at else None
            s.execute(
                update(Run)
                .where(Run.id == run_id)  # a run still being worked on stays `running`
                .values(
                    status=case((Run.status == RunStatus.running, RunStatus.running), else_=RunStatus.queued),
                    finished_at=None,
                    updated_at=now,
                    deadline_at=deadline,
                )
            )
            return chunk_ids

    def expire_overdue(self, now: datetime | None = None) -> list[str]:
        """Runs past their deadline: unfinished rows `expired` (finished rows stay), run `expired`."""
        now = now or utcnow()
        with self.Session.begin() as s:
            runs = list(
                s.scalars(
                    select(Run.id).where(
                        Run.status.in_(RUN_ACTIVE), Run.deadline_at.is_not(None), Run.deadline_at < now
                    )
                )
            )
            for run_id in runs:
                for cid in s.scalars(select(Chunk.id).where(Chunk.run_id == run_id)):
                    self._close_rows(
                        s, cid, run_id, RequestStatus.expired, "expired", "run passed its deadline"
                    )
                s.execute(
                    update(Run)
                    .where(Run.id == run_id)
                    .values(status=RunStatus.expired, finished_at=now, updated_at=now)
                )
            return runs

    def stale_chunks(self, now: datetime | None = None) -> list[tuple[str, str]]:
        """(chunk_id, queue) of running chunks whose lease expired with rows still queued."""
        now = now or utcnow()
        with self.Session() as s:
            q = (
                select(Chunk.id, Run.queue)
                .join(Run, Run.id == Chunk.run_id)
                .where(
                    Chunk.status == ChunkStatus.running,
                    Chunk.lease_expires_at < now,
                    Run.status.in_(RUN_ACTIVE),
                    select(Request.id)
                    .where(Request.chunk_id == Chunk.id, Request.status == RequestStatus.queued)
                    .exists(),
                )
            )
            return [(r[0], r[1]) for r in s.execute(q.order_by(Chunk.id))]

    def active_runs(self) -> list[str]:
        with self.Session() as s:
            return list(s.scalars(select(Run.id).where(Run.status.in_(RUN_ACTIVE))))
