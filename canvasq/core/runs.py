"""What users, embedded runs and the fleet's reconcile do to whole runs: find and resume an embedded
run (its owner, its pending chunks, interrupted), cancel, retry rows by status (stuck rows included:
queued rows whose chunk a dead worker holds), expire runs past their deadline, and list the chunks a
reconcile pass re-publishes.

`RunControl` is a face of `core.queue.QueueStore`: it closes rows and finalises runs through the queue
protocol's own `_close_rows`, `finalize_run` and `run_status`, which `QueueStore` defines."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import and_, case, func, insert, or_, select, update
from sqlalchemy.orm import Session

from canvasq.core.db import StoreBase, rowcount
from canvasq.core.statuses import RUN_ACTIVE, ChunkStatus, RequestStatus, RunStatus
from canvasq.core.tables import Chunk, Request, Run, Worker, utcnow


class RunControl(StoreBase):
    """Whole-run control over the store's engine (see the module docstring)."""

    # the queue protocol's, defined by `QueueStore`
    def _close_rows(
        self, s: Session, chunk_id: str, run_id: str, status: str, code: str, message: str
    ) -> int:
        raise NotImplementedError

    def finalize_run(self, run_id: str) -> str | None:
        raise NotImplementedError

    def run_status(self, run_id: str) -> str | None:
        raise NotImplementedError

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
            chunk_ids = self._rechunk_rows(s, run_id, ids, chunk_size, now)
            self._close_emptied_chunks(s, [c for c in old_chunks if c], now)
            self._requeue_run(s, run_id, now)
            return chunk_ids

    def _rechunk_rows(
        self, s: Session, run_id: str, ids: list[str], chunk_size: int, now: datetime
    ) -> list[str]:
        """Queue `ids` into new chunks of `chunk_size` after the run's last; returns their ids."""
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
        return chunk_ids

    @staticmethod
    def _close_emptied_chunks(s: Session, chunk_ids: list[str], now: datetime) -> None:
        """Mark `done` the queued or running chunks among `chunk_ids` that have no queued row left."""
        # a stuck chunk whose rows all moved is over: neither reconcile nor its dead owner's
        # late renewal has anything left in it
        s.execute(
            update(Chunk)
            .where(
                Chunk.id.in_(chunk_ids),
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

    @staticmethod
    def _requeue_run(s: Session, run_id: str, now: datetime) -> None:
        """Reopen a retried run: `queued` unless still `running`, with a fresh deadline."""
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
        return self._active_chunks(
            Chunk.status == ChunkStatus.running,
            Chunk.lease_expires_at < (now or utcnow()),
            select(Request.id)
            .where(Request.chunk_id == Chunk.id, Request.status == RequestStatus.queued)
            .exists(),
        )

    def waiting_chunks(self, published_before: datetime, limit: int | None = None) -> list[tuple[str, str]]:
        """(chunk_id, queue) of queued chunks of active runs, published before then and never claimed
        since: each should have its message in the broker (`worker.lost` checks that it does); the
        first `limit` by chunk id."""
        return self._active_chunks(
            Chunk.status == ChunkStatus.queued, Chunk.published_at < published_before, limit=limit
        )

    def _active_chunks(self, *where, limit: int | None = None) -> list[tuple[str, str]]:
        """(chunk_id, queue) of active runs' chunks that meet `where`, by chunk id."""
        with self.Session() as s:
            q = (
                select(Chunk.id, Run.queue)
                .join(Run, Run.id == Chunk.run_id)
                .where(Run.status.in_(RUN_ACTIVE), *where)
            )
            return [(r[0], r[1]) for r in s.execute(q.order_by(Chunk.id).limit(limit))]

    def unpublish(self, chunk_ids: Sequence[str], published_before: datetime) -> list[str]:
        """Queued chunks published before then → unpublished (the outbox), conditionally, so a chunk
        claimed or re-published meanwhile is left alone. Returns the ids changed."""
        done = []
        with self.Session.begin() as s:
            for cid in chunk_ids:
                res = s.execute(
                    update(Chunk)
                    .where(
                        Chunk.id == cid,
                        Chunk.status == ChunkStatus.queued,
                        Chunk.published_at < published_before,
                    )
                    .values(published_at=None, updated_at=utcnow())
                )
                if rowcount(res) == 1:
                    done.append(cid)
        return done

    def active_runs(self) -> list[str]:
        with self.Session() as s:
            return list(s.scalars(select(Run.id).where(Run.status.in_(RUN_ACTIVE))))
