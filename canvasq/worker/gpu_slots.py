"""Pick a GPU for a worker container that can see every GPU of its host.

`docker compose --scale worker=N` gives every replica the same reservation, so replicas cannot be
told apart by the compose file (docker/compose#11863). Each worker instead claims a free slot
`0..slots-1` for its host in Redis (SET NX with a TTL, refreshed by a thread) and exports
`CUDA_VISIBLE_DEVICES=<slot>` before the Celery child starts. A dead container's slot frees itself
when its TTL lapses. No torch or CUDA here: this runs in the worker's parent process.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

log = logging.getLogger(__name__)

KEY = "canvasq:gpu-slot:{host}:{slot}"


class NoFreeSlot(RuntimeError):
    pass


class GpuSlot:
    def __init__(self, client, host: str, slot: int, token: str, ttl_s: int):
        self.client, self.host, self.slot, self.token, self.ttl_s = client, host, slot, token, ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return KEY.format(host=self.host, slot=self.slot)

    def refresh(self) -> bool:
        """Extend the TTL while we still own the slot (compare-and-expire, atomic in Lua)."""
        script = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
        return bool(self.client.eval(script, 1, self.key, self.token, self.ttl_s))

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
        script = (
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
        )
        try:
            self.client.eval(script, 1, self.key, self.token)
        except Exception as exc:  # noqa: BLE001 the slot's TTL frees it anyway
            log.debug("gpu slot release failed (its TTL frees it): %s", exc)


def claim_slot(redis_url: str, host: str, slots: int, ttl_s: int = 90) -> GpuSlot:
    import redis

    client = redis.Redis.from_url(redis_url)
    token = f"{os.getpid()}:{uuid.uuid4().hex}"
    for slot in range(slots):
        if client.set(KEY.format(host=host, slot=slot), token, nx=True, ex=ttl_s):
            return GpuSlot(client, host, slot, token, ttl_s)
    raise NoFreeSlot(f"all {slots} GPU slots of host {host!r} are taken")
