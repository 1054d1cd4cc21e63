"""Thin Celery adapters: deserialize, call the engine, let Celery ack. No logic lives here.

Transient persistence errors (database or Redis connection) retry with backoff; anything
deterministic has already become an `errored` row inside the engine. A soft time limit keeps the
rows written so far and errors the rest (`timeout`), so the chunk is handled once, not looped.
"""

from __future__ import annotations

import os

from celery import signals
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import OperationalError

from canvasq.worker.celery_app import TASK_NAME, app


class ChunkTask(app.Task):
    def on_failure(self, exc, task_id, args, kwargs, einfo):
        # Celery ≥ 5.5 calls this in the main process when the hard limit killed the child; the
        # message is acked (acks_on_timeout), so without this the chunk's rows stayed queued forever.
        if isinstance(exc, TimeLimitExceeded) and not isinstance(exc, SoftTimeLimitExceeded) and args:
            from canvasq.worker.engine import Engine

            engine = Engine(worker_id=f"main:{os.getpid()}")  # not get_engine(): children fork from here
            try:
                engine.abandon_chunk(
                    args[0],
                    "timeout",
                    f"hard time limit ({engine.settings.hard_time_limit}s) exceeded; process replaced",
                )
            finally:
                engine.store.dispose()


@app.task(
    name=TASK_NAME,
    base=ChunkTask,
    bind=True,
    acks_late=True,
    autoretry_for=(OperationalError, RedisConnectionError),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=5,
)
def process_chunk(self, chunk_id: str) -> dict:
    from dataclasses import asdict

    from canvasq.worker.engine import get_engine

    engine = get_engine()
    engine.interrupts = (SoftTimeLimitExceeded,)
    try:
        return asdict(engine.run_chunk(chunk_id))
    except SoftTimeLimitExceeded:
        engine.abandon_chunk(
            chunk_id, "timeout", f"soft time limit ({engine.settings.soft_time_limit}s) exceeded"
        )
        return {"chunk": chunk_id, "state": "timeout"}


# A pool child's engine: started when the child starts (after the fork: no CUDA in the parent), stopped
# when it ends. Here, not in celery_app, so the app (which producers import) knows nothing of the
# engine; the worker imports this module (the app's `include`) before it forks its children.
@signals.worker_process_init.connect
def _child_start(**_kw):
    from canvasq.worker.engine import start_process

    start_process()


@signals.worker_process_shutdown.connect
def _child_stop(**_kw):
    from canvasq.worker.engine import stop_process

    stop_process()
