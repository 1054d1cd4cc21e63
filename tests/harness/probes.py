"""Read-only probes into the store and the broker that scenarios wait on and assert with."""

from __future__ import annotations

from sqlalchemy import func, select

from canvasq.core.store import Store
from canvasq.core.tables import Chunk, Output, Request


def mid_chunk(store: Store, run_id: str) -> str | None:
    """A running chunk of the run with some rows finished and some still queued (a partial chunk)."""
    with store.Session() as s:
        rows = s.execute(
            select(Request.chunk_id, Request.status, func.count())
            .join(Chunk, Chunk.id == Request.chunk_id)
            .where(Request.run_id == run_id, Chunk.status == "running")
            .group_by(Request.chunk_id, Request.status)
        ).all()
    by_chunk: dict[str, dict[str, int]] = {}
    for cid, st, n in rows:
        by_chunk.setdefault(cid, {})[st] = n
    for cid, sts in sorted(by_chunk.items()):
        if sts.get("queued") and sum(n for k, n in sts.items() if k != "queued"):
            return cid
    return None


def running_chunks(store: Store, run_id: str) -> dict[str, str | None]:
    with store.Session() as s:
        return dict(
            s.execute(
                select(Chunk.id, Chunk.worker_id).where(Chunk.run_id == run_id, Chunk.status == "running")
            ).all()
        )


def chunk_rows(store: Store, chunk_id: str) -> dict[str, str]:
    with store.Session() as s:
        return dict(
            s.execute(select(Request.custom_id, Request.status).where(Request.chunk_id == chunk_id)).all()
        )


def chunk_attempts(store: Store, run_id: str) -> dict[str, int]:
    with store.Session() as s:
        return dict(s.execute(select(Chunk.id, Chunk.attempts).where(Chunk.run_id == run_id)).all())


def outputs_snapshot(store: Store, run_id: str) -> dict[str, tuple]:
    """custom_id -> (status-defining fields) of every output row: compare before/after a fault."""
    with store.Session() as s:
        rows = s.execute(
            select(
                Output.custom_id,
                Output.text,
                Output.error_code,
                Output.worker_id,
                Output.updated_at,
                Output.completion_tokens,
            ).where(Output.run_id == run_id)
        ).all()
    return {r[0]: tuple(r[1:]) for r in rows}


def outputs_by_worker(store: Store, run_id: str) -> dict[str | None, int]:
    with store.Session() as s:
        return dict(
            s.execute(
                select(Output.worker_id, func.count())
                .where(Output.run_id == run_id)
                .group_by(Output.worker_id)
            ).all()
        )


def unacked(redis_client) -> int:
    """Messages delivered to some worker and not yet acknowledged (kombu's Redis `unacked` hash)."""
    return int(redis_client.hlen("unacked"))


def work_log(path) -> list[tuple[int, str]]:
    """(pid, custom_id) rows written by CANVASQ_TEST_WORK_LOG: every row a worker started to decode."""
    try:
        with open(path) as fh:
            return [(int(p), c) for p, c in (line.split() for line in fh if line.strip())]
    except FileNotFoundError:
        return []
