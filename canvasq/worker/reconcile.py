"""One reconcile pass over the store: expire runs past their deadline, publish chunks a crash left
unpublished (the outbox), re-publish chunks whose lease expired and chunks whose message the
broker lost (`worker.lost`), finalise runs with no row left queued. Every worker runs a pass every
`reconcile_s` (`reconcile_loop`, one worker per interval across the fleet, by a lock in Redis);
`canvasq reconcile` runs one by hand, or in a loop.

A worker renews the lease of the chunk it works on with every heartbeat (`lease_s`, default 60 s,
against a 15 s heartbeat), so a lease lapses only when its worker died or lost the store: a dead
worker's chunk is re-published within lease_s + reconcile_s, not after Redis's visibility timeout
(which stays the broker's own backstop: the dead delivery comes back then, finds the rows done or
being done, and writes nothing twice, since only rows still `queued` are written).

A stale chunk is re-published once: it goes back to `queued` with its lease cleared, so the next
pass does not publish it again while its message waits behind a long queue (each extra message
would be one more delivery counted against max_attempts, and dead-letter healthy rows). A live
worker whose lease lapsed anyway (the store unreachable for longer than a lease) keeps working:
its writes of rows still queued are as good as anyone's, and its renewals stop applying once the
chunk is queued again or claimed by another worker.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import update

from canvasq.core.db import rowcount
from canvasq.core.queue import QueueStore
from canvasq.core.settings import Settings, mask_url
from canvasq.core.statuses import ChunkStatus
from canvasq.core.tables import Chunk, utcnow
from canvasq.worker.lost import Scan, lost_chunks

log = logging.getLogger(__name__)

Publish = Callable[[Sequence[str], str, Settings], int]


@dataclass
class ReconcileReport:
    published: int
    republished: int
    expired: list[str]
    finalised: list[str]
    lost: int = 0

    def line(self) -> str:
        total = self.published + self.republished + self.lost
        return (
            f"published {total} chunks ({self.republished} with expired leases, {self.lost} lost by the broker), "
            f"expired {len(self.expired)} runs, finalised {len(self.finalised)} runs"
        )

    def __bool__(self) -> bool:
        return bool(self.published or self.republished or self.lost or self.expired or self.finalised)


def requeue_stale(store: QueueStore, chunk_ids: Sequence[str], older_than) -> list[str]:
    """Running chunks whose lease expired before `older_than` → queued, lease cleared (conditional,
    so a chunk a worker claimed or renewed meanwhile is left alone). Returns the ids requeued."""
    done = []
    now = utcnow()
    with store.Session.begin() as s:
        for cid in chunk_ids:
            res = s.execute(
                update(Chunk)
                .where(
                    Chunk.id == cid, Chunk.status == ChunkStatus.running, Chunk.lease_expires_at < older_than
                )
                .values(
                    status=ChunkStatus.queued,
                    lease_expires_at=None,
                    published_at=None,
                    claimed_ahead=False,
                    updated_at=now,
                )
            )
            if rowcount(res) == 1:
                done.append(cid)
    return done


# A periodic pass leaves alone the outbox rows younger than this: a submit publishes its chunks
# (in batches, each marked as it goes) right after storing them, and a pass that published them too
# would deliver each chunk twice, and count both deliveries toward max_attempts.
OUTBOX_GRACE_S = 60.0


def reconcile_once(
    store: QueueStore,
    settings: Settings,
    publish: Publish | None = None,
    outbox_grace_s: float = 0.0,
    scan: Scan | None = None,
) -> ReconcileReport:
    """One pass. `outbox_grace_s`: publish only unpublished chunks stored at least that long ago
    (0 for a pass by hand, which publishes every one; OUTBOX_GRACE_S for the periodic ones).
    `scan`: what the broker holds of a queue (`worker.lost.broker_chunk_ids`, read from Redis)."""
    if publish is None:
        from canvasq.worker.celery_app import publish_chunks

        publish = publish_chunks
    expired = store.expire_overdue()
    by_queue: dict[str, list[str]] = {}
    for cid, q in store.unpublished_chunks(older_than=utcnow() - timedelta(seconds=outbox_grace_s)):
        by_queue.setdefault(q, []).append(cid)
    published = 0
    for q, ids in by_queue.items():
        if q == "embedded":
            continue
        publish(ids, q, settings)
        store.mark_published(ids)
        published += len(ids)
    cutoff = utcnow()
    stale: dict[str, list[str]] = {}
    for cid, q in store.stale_chunks(cutoff):
        if q != "embedded":
            stale.setdefault(q, []).append(cid)
    republished = 0
    for q, ids in stale.items():
        ids = requeue_stale(store, ids, cutoff)
        if ids:  # published_at stays NULL until the publish succeeds: a failed one is retried as outbox
            log.warning(
                "re-publishing %d chunk(s) whose worker stopped renewing the lease: %s", len(ids), ids
            )
            publish(ids, q, settings)
            store.mark_published(ids)
            republished += len(ids)
    lost = 0
    for q, ids in lost_chunks(store, settings, scan).items():
        ids = store.unpublish(ids, utcnow())
        if ids:  # unpublished first: a failed publish is retried as outbox by the next pass
            log.warning("re-publishing %d chunk(s) whose message the broker lost: %s", len(ids), ids)
            publish(ids, q, settings)
            store.mark_published(ids)
            lost += len(ids)
    finalised = [r for r in store.active_runs() if store.finalize_run(r)]
    return ReconcileReport(published, republished, expired, finalised, lost)


def lock_key(settings: Settings) -> str:
    """One reconcile lock per store (fleets with different databases may share a Redis)."""
    return "canvasq:reconcile:" + hashlib.sha256(settings.database_url.encode()).hexdigest()[:16]


def _take_lock(client, key: str, owner: str, ttl_s: float) -> bool:
    """The fleet's reconcile turn: a redis-py `Lock` taken without blocking and never released, its
    TTL a little under the interval, so at most one pass runs per interval across the fleet and a
    holder that dies frees it by itself. No Redis client (another broker): always."""
    if client is None:
        return True
    lock = client.lock(key, timeout=max(0.1, ttl_s * 0.9), thread_local=False)
    return bool(lock.acquire(blocking=False, token=owner))


def reconcile_loop(
    store: QueueStore, settings: Settings, stop: threading.Event, owner: str, publish: Publish | None = None
) -> None:
    """Every settings.reconcile_s until `stop`: take the fleet's lock, run one pass. Failures are
    logged and the loop goes on (the store or the broker may be briefly down)."""
    client = None
    if settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        import redis

        client = redis.Redis.from_url(settings.broker_url, socket_timeout=10, socket_connect_timeout=10)
    key = lock_key(settings)
    try:
        while not stop.wait(settings.reconcile_s):
            try:
                if not _take_lock(client, key, owner, settings.reconcile_s):
                    continue
                rep = reconcile_once(store, settings, publish, OUTBOX_GRACE_S)
                if rep:
                    log.info("reconcile: %s", rep.line())
            except Exception as exc:  # noqa: BLE001 the next interval tries again
                log.warning("reconcile pass failed: %s", mask_url(str(exc)))
    finally:
        if client is not None:
            client.close()
