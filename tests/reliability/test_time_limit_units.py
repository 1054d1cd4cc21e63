"""The soft time limit must end the chunk even though the decoders catch every exception inside a
step (one forward serves every live row): the runtime hands its `interrupts` to the decoder, which
raises `Interrupted` (the rows that had finished) from the limit instead of erroring rows.
Runtime-level unit test (T8's in-process half): a real SQLite store, a decode function that behaves
like a decoder hit by the limit in its second batch after one row of it had finished."""

from __future__ import annotations

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from canvasq.core.schemas import Job
from canvasq.core.settings import Settings
from canvasq.core.store import Store
from canvasq.decoders.types import DecodeResult, Interrupted
from canvasq.worker.engine import Engine
from tests.harness.checks import assert_exactly_once


class _Bundle:  # the runtime only tokenises through the bundle; decoding is the decode_fn below
    def encode_prompt(self, text, task):
        return [5, 6, 7]


def _decoder_hit_by_soft_limit():
    calls = {"n": 0}

    def decode(
        bundle,
        batch,
        decoder,
        should_stop=None,
        routing=None,
        interrupts=(),
        cuda_graphs=None,
        experts=None,
        **_service,
    ):
        calls["n"] += 1
        ok = [
            DecodeResult(r.custom_id, [9, 9], "ok", "length", 3, 2, decoder="official")
            for r in batch.requests
        ]
        if calls["n"] == 1:
            return ok
        exc = SoftTimeLimitExceeded()
        if isinstance(exc, interrupts):  # the decoders' contract (tests/decoders test it on real ones)
            raise Interrupted(exc, ok[:1]) from exc
        return ok[:1] + [
            DecodeResult(r.custom_id, [], "", "error", 3, 1, error=f"SoftTimeLimitExceeded: {exc!r}")
            for r in batch.requests[1:]
        ]

    return decode


@pytest.fixture
def store(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'u.sqlite'}")
    st.upgrade()
    yield st
    st.dispose()


def _run(store):
    jobs = [Job(f"u{i}", "p", "math", 8, None, i + 1) for i in range(6)]
    return store.create_run(jobs, model="m", queue="q", chunk_size=6)


def test_soft_limit_swallowed_by_the_decoder_still_ends_the_chunk(store, tmp_path):
    created = _run(store)
    engine = Engine(
        settings=Settings(database_url=store.url, model="m", decode_batch_size=2, device="cpu"),
        store=store,
        bundle=_Bundle(),
        decode_fn=_decoder_hit_by_soft_limit(),
        worker_id="t",
    )
    engine.interrupts = (SoftTimeLimitExceeded,)  # what the Celery task sets
    cid = created.chunk_ids[0]
    with pytest.raises(SoftTimeLimitExceeded):
        engine.process_chunk(cid)
    engine.abandon_chunk(cid, "timeout", "soft time limit exceeded")  # what the task does next
    rep = assert_exactly_once(
        store,
        created.run_id,
        [f"u{i}" for i in range(6)],
        run_status="completed",
        statuses={"done": 3, "errored": 3},  # batch 1, and the row of batch 2 that finished first
    )
    assert rep.error_codes == {"timeout": 3}


def test_without_interrupts_a_failing_batch_errors_only_its_rows(store):
    """Embedded mode (no Celery): the same failure is a per-batch decode error, the chunk goes on."""
    created = _run(store)
    engine = Engine(
        settings=Settings(database_url=store.url, model="m", decode_batch_size=2, device="cpu"),
        store=store,
        bundle=_Bundle(),
        decode_fn=_decoder_hit_by_soft_limit(),
        worker_id="t",
    )
    engine.process_chunk(created.chunk_ids[0])
    rep = assert_exactly_once(
        store,
        created.run_id,
        [f"u{i}" for i in range(6)],
        run_status="completed",
        statuses={"done": 4, "errored": 2},
    )
    assert rep.error_codes == {"decode_error": 2}
