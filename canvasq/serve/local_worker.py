"""The `canvasq serve --with-worker` worker: one child process that drains its own queue from SQL,
no broker. Chunks of runs whose queue is `local_queue(...)` are taken in order of their run's
creation; each runs through `Engine.run_chunk` under its lease, as a fleet worker's do.
A chunk left `running` by a killed child still holds queued rows and is taken again at restart.

    python -m canvasq.serve.local_worker QUEUE    (started and restarted by `canvasq serve`)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

from sqlalchemy import select

from canvasq.core.statuses import RUN_ACTIVE
from canvasq.core.tables import Chunk, Request, Run

log = logging.getLogger("canvasq.serve.local_worker")

READY_MARK = "canvasq local worker ready"


def local_queue(settings) -> str:
    return f"local:{settings.queue_for()}"


def next_chunk(store, queue: str) -> str | None:
    """The first chunk, by run then sequence, of an active run on `queue` that still holds queued rows."""
    with store.Session() as s:
        return s.scalar(
            select(Chunk.id)
            .join(Run, Run.id == Chunk.run_id)
            .where(
                Run.queue == queue,
                Run.status.in_(RUN_ACTIVE),
                select(Request.id).where(Request.chunk_id == Chunk.id, Request.status == "queued").exists(),
            )
            .order_by(Run.created_at, Chunk.seq)
            .limit(1)
        )


def main(queue: str, poll_s: float = 0.5, expire_every_s: float = 5.0) -> None:
    from canvasq.core.settings import get_settings
    from canvasq.core.store import Store
    from canvasq.worker.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = get_settings()
    store = Store.from_settings(settings)
    engine = Engine(
        settings=settings, store=store, worker_id=f"local:{socket.gethostname()}:{os.getpid()}", queue=queue
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last_expire = 0.0
    parent = os.getppid()
    try:
        engine.start(metrics=True)
        log.info("%s: %s on %s", READY_MARK, engine.worker_id, queue)
        while not stop.is_set() and os.getppid() == parent:  # the server gone: stop too
            if time.monotonic() - last_expire >= expire_every_s:  # a fleet's reconcile does this
                last_expire = time.monotonic()
                for run_id in store.expire_overdue():
                    log.info("run %s passed its deadline: expired", run_id)
            cid = next_chunk(store, queue)
            if cid is None:
                stop.wait(poll_s)
                continue
            engine.run_chunk(cid)
    finally:
        engine.stop()
        store.dispose()


if __name__ == "__main__":
    main(sys.argv[1])
