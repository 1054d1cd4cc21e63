"""Pick a GPU for a worker container that can see every GPU of its host.

`docker compose --scale worker=N` gives every replica the same reservation, so replicas cannot be
told apart by the compose file (docker/compose#11863). Each worker instead claims a free slot
`0..slots-1` for its host in Redis and exports `CUDA_VISIBLE_DEVICES=<slot>` before the Celery child
starts. A slot is a redis-py `Lock` (its key set only if absent, with a TTL; extended and released only
with the holder's token), kept by a refresher thread; a dead container's slot frees itself when its
TTL lapses. No torch or CUDA here: this runs in the worker's parent process.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.lock import Lock

log = logging.getLogger(__name__)

KEY = "canvasq:gpu-slot:{host}:{slot}"


class NoFreeSlot(RuntimeError):
    pass


class GpuSlot:
    """A claimed slot: `refresh` while the process runs, `release` when it ends."""

    def __init__(self, lock: Lock, host: str, slot: int, ttl_s: int):
        self.lock, self.host, self.slot, self.ttl_s = lock, host, slot, ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """Reset the TTL while the slot is still ours; False once another holder has it (or none)."""
        from redis.exceptions import LockError

        try:
            return bool(self.lock.reacquire())
        except LockError:
            return False

    def start_refresher(self) -> None:
        def loop():
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.refresh()
                except Exception as exc:  # noqa: BLE001 Redis briefly down: retry next tick, the TTL has slack
                    log.debug("gpu slot refresh failed: %s", exc)

        self._thread = threading.Thread(target=loop, name="canvasq-gpu-slot", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        try:
            self.lock.release()
        except Exception as exc:  # noqa: BLE001 not ours any more, or Redis down: the slot's TTL frees it
            log.debug("gpu slot release failed (its TTL frees it): %s", exc)


def claim_slot(redis_url: str, host: str, slots: int, ttl_s: int = 90) -> GpuSlot:
    """The first free slot of `host`'s `slots`, or NoFreeSlot."""
    import redis

    client = redis.Redis.from_url(redis_url)
    token = f"{os.getpid()}:{uuid.uuid4().hex}"
    for slot in range(slots):
        # thread_local=False: the refresher thread extends what the main thread acquired
        lock = client.lock(KEY.format(host=host, slot=slot), timeout=ttl_s, thread_local=False)
        if lock.acquire(blocking=False, token=token):
            return GpuSlot(lock, host, slot, ttl_s)
    raise NoFreeSlot(f"all {slots} GPU slots of host {host!r} are taken")
