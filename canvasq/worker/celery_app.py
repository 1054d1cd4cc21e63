"""The Celery app: Redis broker, one queue per model, settings from `core.settings`. No torch here.

Flow: api commits run + request rows, then publishes one `canvasq.process_chunk(chunk_id)` message
per chunk to the model's queue → a worker (one per GPU, prefetch 1, late ack) claims the chunk in SQL
→ `canvasq.worker.engine` decodes it. Outputs live in SQL, so results are ignored here.
"""

from __future__ import annotations

import logging

from celery import Celery, signals

from canvasq.core.settings import Settings, get_settings

log = logging.getLogger(__name__)

TASK_NAME = "canvasq.process_chunk"


def celery_config(settings: Settings) -> dict:
    return {
        # A chunk whose worker dies is redelivered; the SQL attempts counter caps the loop (celery#9082).
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,  # a GPU worker holds one chunk, never a backlog
        # On Redis, prefetch 1 still let a busy worker reserve a second chunk (seen in T16); Celery
        # ≥ 5.6 then consumes only while a pool process is free.
        "worker_disable_prefetch": True,
        "task_ignore_result": True,  # outputs are rows in SQL
        "task_soft_time_limit": settings.soft_time_limit,
        "task_time_limit": settings.hard_time_limit,
        # Must exceed the hard limit or Redis hands a running chunk to a second worker (celery#5935).
        # kombu sweeps for expired unacked messages only every interval × throttle seconds (10 × 10
        # by default): a chunk of a SIGKILLed worker came back up to 100 s after its visibility timeout.
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout,
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 10)),
            "unacked_restore_throttle": 1,
            # Each sweep holds a mutex in Redis for a few ms; a worker killed while holding it
            # stopped every sweep in the fleet for kombu's default 300 s. 30 s is far above a sweep.
            "unacked_mutex_expire": 30,
        },
        "task_default_queue": settings.queue_for(),
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_send_task_events": True,  # events for Flower / Prometheus exporters
        "task_send_sent_event": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # ride out a Redis restart
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_proc_alive_timeout": 300,  # the child loads the model at start; give it time
        "worker_max_tasks_per_child": None,  # the model is loaded once per child: keep the child
        "worker_hijack_root_logger": False,
    }


def make_app(settings: Settings | None = None, set_as_current: bool = True) -> Celery:
    settings = settings or get_settings()
    app = Celery(
        "canvasq", broker=settings.broker_url, include=["canvasq.worker.tasks"], set_as_current=set_as_current
    )
    app.conf.update(celery_config(settings))
    return app


_publishers: dict[str, Celery] = {}


def _publisher(settings: Settings) -> Celery:
    if settings.broker_url not in _publishers:
        # not the current app: a worker child publishes from its reconcile thread beside its own app
        _publishers[settings.broker_url] = make_app(settings, set_as_current=False)
    return _publishers[settings.broker_url]


def publish_chunks(chunk_ids, queue: str, settings: Settings | None = None) -> int:
    """Send one message per chunk to `queue` (by task name: the api never imports the tasks)."""
    settings = settings or get_settings()
    app = _publisher(settings)
    n = 0
    with app.producer_or_acquire() as producer:
        for cid in chunk_ids:
            app.send_task(TASK_NAME, args=[cid], queue=queue, producer=producer)
            n += 1
    return n


app = make_app()


@signals.celeryd_init.connect
def _check_at_start(**_kw):
    # Also guards `celery -A canvasq.worker.celery_app worker` started without the canvasq CLI.
    # SystemExit, not ValueError: Celery logs and swallows exceptions raised by signal receivers.
    try:
        get_settings().check_time_limits()  # time limits out of order: ValueError
    except ValueError as exc:
        raise SystemExit(f"canvasq worker refusing to start: {exc}") from None
