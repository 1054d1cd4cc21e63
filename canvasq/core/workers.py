"""A worker's liveness in the store: its row (registered at start) and the heartbeat that keeps it
and the leases of the chunks it holds alive; a lease that lapses is what `reconcile` re-publishes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import update

from canvasq.core.db import StoreBase, rowcount, transient, upsert
from canvasq.core.statuses import ChunkStatus
from canvasq.core.tables import Chunk, Worker, utcnow


class WorkerLiveness(StoreBase):
    """The worker rows and their heartbeats (a face of `core.queue.QueueStore`)."""

    @transient
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
