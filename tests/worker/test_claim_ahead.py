"""Cross-chunk feeding on the real test model and a real SQLite store: a worker whose decode slots
run dry claims the run's next chunks from SQL into the same stream; each chunk is delivered once,
their own messages are then dropped uncounted, and chunks whose rows need another route are given
back untouched."""

from __future__ import annotations

from sqlalchemy import select

from canvasq.core.schemas import Job
from canvasq.core.settings import Settings
from canvasq.core.tables import Chunk, Request
from canvasq.worker.engine import Engine

PROMPT = "Ann has 12 apples. She finds 3 more apples. How many apples does Ann have now?"


def _run(store, n: int, chunk: int, decoders=None):
    jobs = [Job(f"r{i}", PROMPT, "math", 32, (decoders or {}).get(i), i + 1) for i in range(n)]
    run = store.create_run(jobs, model="m", queue="q", decoder="official", chunk_size=chunk)
    store.mark_published(run.chunk_ids)
    return run


def _chunks(store, run_id):
    with store.Session() as s:
        return {
            c.seq: (c.status, c.attempts, c.claimed_ahead)
            for c in s.scalars(select(Chunk).where(Chunk.run_id == run_id))
        }


def _engine(tmp_path, store, bundle, mode: str, worker: str = "test:1") -> Engine:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'w.sqlite'}",
        model=str(bundle.spec),
        device="cpu",
        decode_batch_size=4,
        decode_slots=4,
        max_attempts=3,
        claim_ahead=mode,
    )
    return Engine(settings=settings, store=store, bundle=bundle, worker_id=worker, queue="q")


def _mean_occupancy(occ: list[tuple[int, int]]) -> float:
    return sum(n for n, _ in occ) / sum(s for _, s in occ)


def test_one_delivery_drains_the_run_through_one_stream(tmp_path, wstore, bundle):
    run = _run(wstore, 10, 2)
    out = _engine(tmp_path, wstore, bundle, "on").process_chunk(run.chunk_ids[0])
    assert out.written == 10 and out.claimed_ahead == 4
    assert wstore.run_status(run.run_id) == "completed" and wstore.counts(run.run_id)["done"] == 10
    assert _chunks(wstore, run.run_id) == {
        0: ("done", 1, False),
        **{k: ("done", 1, True) for k in range(1, 5)},
    }
    # the messages of the chunks taken ahead: dropped, not counted as deliveries
    other = _engine(tmp_path, wstore, bundle, "on", worker="test:2")
    for cid in run.chunk_ids[1:]:
        again = other.process_chunk(cid)
        assert again.state == "empty" and again.written == 0
    assert {a for _, a, _ in _chunks(wstore, run.run_id).values()} == {1}

    # A/B, same process and rows: without claiming ahead each chunk's stream drains before the next
    plain_run = _run(wstore, 10, 2)
    plain = _engine(tmp_path, wstore, bundle, "off")
    occ = []
    for cid in plain_run.chunk_ids:
        occ += plain.process_chunk(cid).occupancy
    assert _mean_occupancy(out.occupancy) > _mean_occupancy(occ)


def test_a_chunk_for_another_route_is_given_back(tmp_path, wstore, bundle):
    """Chunk 1 holds pipe rows: given back untouched (queued, its claim uncounted) for its own
    delivery; chunk 2's official rows still join the stream."""
    run = _run(wstore, 6, 2, decoders={2: "pipe", 3: "pipe"})
    out = _engine(tmp_path, wstore, bundle, "on").process_chunk(run.chunk_ids[0])
    assert out.written == 4 and out.claimed_ahead == 1
    assert _chunks(wstore, run.run_id) == {
        0: ("done", 1, False),
        1: ("queued", 0, False),
        2: ("done", 1, True),
    }
    with wstore.Session() as s:
        left = set(
            s.scalars(
                select(Request.custom_id).where(Request.run_id == run.run_id, Request.status == "queued")
            )
        )
    assert left == {"r2", "r3"}


def test_the_arena_is_sized_for_the_runs_longest_rows(tmp_path, wstore, bundle):
    """A later chunk with a larger max_tokens than the first still joins the stream."""
    jobs = [Job(f"r{i}", PROMPT, "math", 16 if i < 2 else 96, None, i + 1) for i in range(4)]
    run = wstore.create_run(jobs, model="m", queue="q", decoder="official", chunk_size=2)
    wstore.mark_published(run.chunk_ids)
    out = _engine(tmp_path, wstore, bundle, "on").process_chunk(run.chunk_ids[0])
    assert out.written == 4 and out.claimed_ahead == 1 and wstore.counts(run.run_id)["done"] == 4


def test_claims_ahead_resolves_per_device_and_never_in_embedded_runs(tmp_path, wstore, bundle):
    assert not _engine(tmp_path, wstore, bundle, "auto").claims_ahead  # auto: GPU workers only
    assert _engine(tmp_path, wstore, bundle, "on").claims_ahead
    embedded = _engine(tmp_path, wstore, bundle, "on")
    embedded.queue = "embedded:run_x"
    assert not embedded.claims_ahead
