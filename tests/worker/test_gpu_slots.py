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
