"""Chunks whose broker message is gone: published, still queued in the store, and in neither the
Redis queue nor kombu's unacked hash.

kombu's Redis transport pops a message (BRPOP) before it records it as unacked. A worker killed
between the two (SIGKILL, the OOM killer, a lost node) takes the message with it: the chunk was
never claimed, so it has no lease to lapse, and it was never unacked, so the visibility timeout
never brings it back. Its run would wait forever (a worker killed right after it finishes a chunk
is killed as it takes the next one, in that window: T21 can do so). Reconcile asks this module which waiting chunks the broker no longer holds and
publishes them again.

The queue and the unacked hash are read in one MULTI, so a restore (unacked → queue) cannot fall
between the two reads; a chunk missing is read again after `RESCAN_S`, so a message a live worker
is between popping and recording is not taken for lost. Only Redis brokers are read (RabbitMQ's
delivery and unacked state are one), and only queues under `MAX_SCAN` messages: a lost message in a
longer queue is found once the queue has drained below that (a pass reads at most `MAX_SCAN`
waiting chunks from the store, the oldest first).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from canvasq.core.queue import QueueStore
from canvasq.core.settings import Settings, mask_url
from canvasq.core.tables import utcnow
from canvasq.worker.celery_app import TASK_NAME, _publisher

log = logging.getLogger(__name__)

# A chunk published this recently is not checked: its submit may still be marking it published.
LOST_GRACE_S = 30.0
RESCAN_S = 1.0
MAX_SCAN = 20_000

Scan = Callable[[str, Settings], "set[str] | None"]


def _chunk_of(message: dict[str, Any]) -> str | None:
    """The chunk id a canvasq task message carries (Celery protocol 2: body [args, kwargs, embed])."""
    if (message.get("headers") or {}).get("task") != TASK_NAME:
        return None
    try:
        body = message.get("body", "")
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except (ValueError, TypeError, IndexError, KeyError):  # not a message this module can read
        return None
    return str(args[0]) if args else None


def broker_chunk_ids(queue: str, settings: Settings) -> set[str] | None:
    """Chunk ids with a message in `queue` or delivered and not yet acked; None where this broker
    cannot be read so (not Redis, or a queue over MAX_SCAN messages)."""
    if not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    with _publisher(settings).connection_for_read() as conn:
        ch: Any = conn.default_channel
        keys = [ch._q_for_pri(queue, pri) for pri in ch.priority_steps]  # kombu's key per priority
        client = ch.client
        if sum(client.llen(k) for k in keys) > MAX_SCAN:
            return None
        with client.pipeline(transaction=True) as pipe:
            for k in keys:
                pipe.lrange(k, 0, -1)
            pipe.hvals(ch.unacked_key)
            *lists, unacked = pipe.execute()
    messages: Iterable[dict[str, Any]] = [json.loads(raw) for lst in lists for raw in lst]
    held = [json.loads(raw)[0] for raw in unacked]  # [message, exchange, routing key]
    return {cid for m in [*messages, *held] if (cid := _chunk_of(m)) is not None}


def lost_chunks(
    store: QueueStore, settings: Settings, scan: Scan | None = None, grace_s: float = LOST_GRACE_S
) -> dict[str, list[str]]:
    """Per queue, waiting chunks published over `grace_s` ago that the broker holds in neither scan
    (`scan`: broker_chunk_ids unless given)."""
    scan = scan or broker_chunk_ids
    waiting: dict[str, list[str]] = {}
    for cid, q in store.waiting_chunks(utcnow() - timedelta(seconds=grace_s), limit=MAX_SCAN):
        if q != "embedded":
            waiting.setdefault(q, []).append(cid)
    lost: dict[str, list[str]] = {}
    for q, ids in waiting.items():
        try:
            seen = scan(q, settings)
            if seen is None or not (missing := set(ids) - seen):
                continue
            time.sleep(RESCAN_S)
            seen = scan(q, settings)
        except Exception as exc:  # noqa: BLE001 - the broker unreadable now: the next pass tries again
            log.warning("reading queue %s for lost messages failed: %s", q, mask_url(str(exc)))
            continue
        if seen is not None and (missing := missing - seen):
            lost[q] = sorted(missing)
    return lost
