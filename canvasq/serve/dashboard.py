"""The run dashboard: one page (`/dashboard`, plain HTML + a JavaScript module, SVG charts; nothing to
build) over the Batch API and two read-only routes of its own. It shows the key's project's
batches with live progress, a batch's committed tokens per second over time and its errors by code,
and one row's trace (window rows and commits per forward, as `canvasq trace --plot` draws it).

The page holds the key in the tab's sessionStorage and sends it as a bearer key, like any client.
"""

from __future__ import annotations

import math
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from sqlalchemy import func, select

from canvasq.core.tables import Output
from canvasq.serve.auth import Who
from canvasq.serve.files import ApiError

STATIC = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
MAX_POINTS = 120  # tok/s buckets per chart


def throughput(rows: list[tuple], start, bucket_s: float | None = None) -> list[dict]:
    """Committed tokens per second in buckets, from (finished_at, tokens) of the run's rows."""
    if not rows or start is None:
        return []
    span = max((rows[-1][0] - start).total_seconds(), 1.0)
    bucket_s = bucket_s or max(1.0, math.ceil(span / MAX_POINTS))
    n = int(span // bucket_s) + 1
    tokens = [0] * n
    for at, tok in rows:
        tokens[min(n - 1, max(0, int((at - start).total_seconds() // bucket_s)))] += tok
    return [{"t": round(i * bucket_s, 3), "tok_s": tokens[i] / bucket_s} for i in range(n)]


def batch_detail(store, run) -> dict:
    """A run's tok/s over time, its errors by code (most frequent first, one example message each) and
    the first finished custom_ids, for the page to pick a trace from."""
    with store.Session() as s:
        done = s.execute(
            select(Output.updated_at, Output.completion_tokens)
            .where(Output.run_id == run.id, Output.error_code.is_(None))
            .order_by(Output.updated_at)
        ).all()
        errors = s.execute(
            select(Output.error_code, func.count(), func.min(Output.error_message))
            .where(Output.run_id == run.id, Output.error_code.is_not(None))
            .group_by(Output.error_code)
            .order_by(func.count().desc())
        ).all()
        ids = list(
            s.scalars(
                select(Output.custom_id)
                .where(Output.run_id == run.id, Output.error_code.is_(None))
                .order_by(Output.updated_at)
                .limit(50)
            )
        )
    return {
        "run_id": run.id,
        "throughput": throughput(done, run.started_at or run.created_at),
        "errors": [{"code": c, "count": n, "example": m} for c, n, m in errors],
        "custom_ids": ids,
    }


def trace_forwards(recs) -> list[dict]:
    """One row's trace records as the page's chart reads them, one dict per forward."""
    return [
        {
            "forward": t.forward_index,
            "rows": t.rows,
            "commits": t.commits,
            "own_rows": t.own_rows,
            "own_commits": t.own_commits,
            "kind": t.kind,
            "ms": t.ms,
        }
        for t in recs
    ]


def register(app: FastAPI, store, batches) -> None:
    """The page, its assets and its two read-only routes, on the Batch API's keys."""

    @app.get("/dashboard", include_in_schema=False)
    def page():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/{name}", include_in_schema=False)
    def asset(name: str):
        if name not in ASSETS:
            raise ApiError(404, f"no dashboard asset {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    def run_of(who, batch_id: str):
        _, run = batches._row(who.project, batch_id)  # 404 for another project's batch
        return run

    @app.get("/v1/dashboard/batches/{batch_id}", summary="canvasq: a batch's tok/s over time and errors")
    def detail(batch_id: str, who: Who):
        run = run_of(who, batch_id)
        if run is None:
            return {"throughput": [], "errors": [], "custom_ids": []}
        return batch_detail(store, run)

    @app.get(
        "/v1/dashboard/batches/{batch_id}/trace/{custom_id}",
        summary="canvasq: one row's forwards (window rows, commits, this row's share)",
    )
    def trace(batch_id: str, custom_id: str, who: Who):
        run = run_of(who, batch_id)
        recs = store.traces(run.id, custom_id) if run is not None else []
        if not recs:
            raise ApiError(404, f"no trace for {custom_id!r} in {batch_id}", param="custom_id")
        return {"custom_id": custom_id, "forwards": trace_forwards(recs)}
