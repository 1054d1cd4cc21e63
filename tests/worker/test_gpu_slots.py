"""GPU slot claims on the real Redis: distinct slots per worker, refusal when full, release frees."""

from __future__ import annotations

import uuid

import pytest

from canvasq.worker.gpu_slots import NoFreeSlot, claim_slot
from tests.harness.backends import REDIS_URL


def test_slots_are_distinct_and_bounded():
    host = f"test-{uuid.uuid4().hex[:8]}"
    a = claim_slot(REDIS_URL, host, 2, ttl_s=30)
    b = claim_slot(REDIS_URL, host, 2, ttl_s=30)
    try:
        assert {a.slot, b.slot} == {0, 1}
        with pytest.raises(NoFreeSlot):
            claim_slot(REDIS_URL, host, 2, ttl_s=30)
        assert a.refresh() and b.refresh()
        a.release()
        assert not a.refresh()  # no longer ours
        c = claim_slot(REDIS_URL, host, 2, ttl_s=30)
        assert c.slot == a.slot
        c.release()
    finally:
        a.release()
        b.release()


def test_the_refresher_thread_keeps_the_slot_past_its_ttl():
    """The refresher runs in its own thread and extends what the claiming thread acquired: after three
    TTLs the slot is still held (a thread-local lock token would let it lapse after one)."""
    import threading
    import time

    host = f"test-{uuid.uuid4().hex[:8]}"
    a = claim_slot(REDIS_URL, host, 1, ttl_s=1)
    try:
        results = []
        for _ in range(6):
            t = threading.Thread(target=lambda: results.append(a.refresh()))
            t.start()
            t.join()
            time.sleep(0.5)
        assert all(results), results
        with pytest.raises(NoFreeSlot):
            claim_slot(REDIS_URL, host, 1, ttl_s=1)
    finally:
        a.release()
    time.sleep(0.1)
    claim_slot(REDIS_URL, host, 1, ttl_s=1).release()  # released: free again
