"""The producers' face of the queue protocol (`core.queue.QueueStore`): a run, its chunks and its
requests inserted in one transaction (the outbox: all committed before any chunk is published), the
published marks, and the outbox's leftovers that `reconcile` publishes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from canvasq.core.db import StoreBase, new_run_id
from canvasq.core.records import RunCreated
from canvasq.core.schemas import Job
from canvasq.core.statuses import ChunkStatus, RequestStatus, RunStatus
from canvasq.core.tables import Chunk, Request, Run, utcnow


def _insert_rows(
    s: Session, run_id: str, jobs: Iterable[Job], chunk_size: int, now: datetime, batch_rows: int
) -> tuple[list[str], int]:
    """The run's chunk and request rows, streamed in executemany batches of `batch_rows` (chunks
    first: the requests point at them); returns the chunk ids and the request count."""
    chunk_ids: list[str] = []
    chunks: list[dict] = []  # rows not yet inserted
    rows: list[dict] = []

    def flush() -> None:
        for table, pending in ((Chunk, chunks), (Request, rows)):
            if pending:
                s.execute(insert(table), pending)
                pending.clear()

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
        rows.append(
            {
                "run_id": run_id,
                "custom_id": job.custom_id,
                "line_no": job.line_no,
                "prompt": job.prompt,
                "task": job.task,
                "max_tokens": job.max_tokens,
                "decoder": job.decoder,
                "stop": list(job.stop) or None,
                "response_format": job.response_format,
                "think": job.think,
                "chunk_id": chunk_ids[seq],
                "status": RequestStatus.queued,
                "updated_at": now,
            }
        )
        n += 1
        if len(rows) >= batch_rows:
            flush()
    flush()
    if n == 0:
        raise ValueError("a run needs at least one request")
    return chunk_ids, n


class Submission(StoreBase):
    """Creating runs and publishing their chunks (a face of `core.queue.QueueStore`)."""

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
            chunk_ids, n = _insert_rows(s, run_id, jobs, chunk_size, now, batch_rows)
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
