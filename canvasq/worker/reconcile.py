"""One reconcile pass over the store (`canvasq reconcile`, once or in a loop): expire runs past
their deadline, publish chunks a crash left unpublished (the outbox), re-publish chunks whose lease
expired, finalise runs with no row left queued.

A stale chunk is re-published once: it goes back to `queued` with its lease cleared, so the next
pass does not publish it again while its message waits behind a long queue (each extra message
would be one more delivery counted against max_attempts, and dead-letter healthy rows). Redis
restores the message of a SIGKILLed worker by itself after the visibility timeout, so the
reconciler waits one more visibility timeout before it steps in (it is for messages Redis lost,
or deliveries that ended without finishing their rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import update

from canvasq.api.models import Chunk, utcnow
from canvasq.api.settings import Settings
from canvasq.api.store import Store

Publish = Callable[[Sequence[str], str, Settings], int]


@dataclass
class ReconcileReport:
    published: int
    republished: int
    expired: list[str]
    finalised: list[str]

    def line(self) -> str:
        return (
            f"published {self.published + self.republished} chunks ({self.republished} with expired leases), "
            f"expired {len(self.expired)} runs, finalised {len(self.finalised)} runs"
        )


def requeue_stale(store: Store, chunk_ids: Sequence[str], older_than) -> list[str]:
    """Running chunks whose lease expired before `older_than` → queued, lease cleared (conditional,
    so a chunk a worker claimed meanwhile is left alone). Returns the ids that were requeued."""
    done = []
    now = utcnow()
    with store.Session.begin() as s:
        for cid in chunk_ids:
            res = s.execute(
                update(Chunk)
                .where(Chunk.id == cid, Chunk.status == "running", Chunk.lease_expires_at < older_than)
                .values(status="queued", lease_expires_at=None, published_at=None, updated_at=now)
            )
            if res.rowcount == 1:
                done.append(cid)
    return done


def reconcile_once(store: Store, settings: Settings, publish: Publish | None = None) -> ReconcileReport:
    if publish is None:
        from canvasq.worker.celery_app import publish_chunks as publish
    expired = store.expire_overdue()
    by_queue: dict[str, list[str]] = {}
    for cid, q in store.unpublished_chunks():
        by_queue.setdefault(q, []).append(cid)
    published = 0
    for q, ids in by_queue.items():
        if q == "embedded":
            continue
        publish(ids, q, settings)
        store.mark_published(ids)
        published += len(ids)
    cutoff = utcnow() - timedelta(seconds=settings.visibility_timeout)
    stale: dict[str, list[str]] = {}
    for cid, q in store.stale_chunks(cutoff):
        if q != "embedded":
            stale.setdefault(q, []).append(cid)
    republished = 0
    for q, ids in stale.items():
        ids = requeue_stale(store, ids, cutoff)
        if ids:  # published_at stays NULL until the publish succeeds: a failed one is retried as outbox
            publish(ids, q, settings)
            store.mark_published(ids)
            republished += len(ids)
    finalised = [r for r in store.active_runs() if store.finalize_run(r)]
    return ReconcileReport(published, republished, expired, finalised)
