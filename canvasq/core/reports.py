"""Reports over the store: run summaries, run lists, results for export, traces, worker throughput.
Read-only; counts, tokens and throughput are GROUP BY over rows, never stored."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

from sqlalchemy import Row, and_, case, func, select

from canvasq.core.db import StoreBase
from canvasq.core.statuses import REQUEST_STATUSES, REQUEST_TERMINAL, RUN_ACTIVE
from canvasq.core.tables import (
    Chunk,
    ForwardTraceRow,
    Output,
    Request,
    Run,
    Worker,
    utcnow,
)

# ---------------------------------------------------------------------------------------- progress

IDLE_GAP_S = 120.0  # a longer pause between finished rows (and 20x their median gap) is idle time
RATE_WINDOW_S = 120.0  # the current rate: rows finished in this much of the latest active time


def active_wall(started: datetime | None, finishes: Sequence[datetime], now: datetime | None = None) -> float:
    """Seconds a run was being generated: its start to its first finished row, the gaps between finished
    rows except idle ones (longer than IDLE_GAP_S and 20x the median gap: the run had ended and was later
    retried or resumed), and, while it runs (`now`), the time since its last finished row or its start.
    tok/s over this does not fall (or restart) after a retry: the tokens and the time are both the run's."""
    ts = sorted(finishes)
    if started is None:
        return 0.0
    gaps = [(b - a).total_seconds() for a, b in pairwise(ts)]
    median = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    idle = max(IDLE_GAP_S, 20 * median)
    wall = sum(g for g in gaps if g <= idle)
    if ts and started < ts[0]:
        wall += (ts[0] - started).total_seconds()
    if now is not None:
        since = max(ts[-1], started) if ts else started
        wall += max(0.0, (now - since).total_seconds())
    return wall


def recent_rate(finishes: Sequence[datetime], now: datetime | None = None) -> float | None:
    """Rows per second at the end of the run so far: finished rows over the last RATE_WINDOW_S seconds
    (of the time since the first row finished, when that is shorter); None before two rows finish."""
    if len(finishes) < 2:
        return None
    ts = sorted(finishes)
    end = max(now or ts[-1], ts[-1])
    start = max(end - timedelta(seconds=RATE_WINDOW_S), ts[0])
    n = sum(1 for t in ts if t > start)
    span = (end - start).total_seconds()
    return n / span if span > 0 and n else None


def _summary(
    run: Run,
    counts: dict[str, int],
    per_dec: Sequence,
    finishes: list[datetime],
    in_flight: int,
    now: datetime,
) -> dict[str, Any]:
    """One run's summary from its rows' aggregates (`Reports.run_summaries`)."""
    counts = {**counts, "total": sum(counts.values())}
    tokens = sum(d.tokens for d in per_dec)
    ptoks = sum(d.prompt_tokens for d in per_dec)
    forwards = sum(d.forwards for d in per_dec)
    gen_ms = sum(d.gen_ms for d in per_dec)
    active = run.status in RUN_ACTIVE
    running_at = now if active and (in_flight or run.status == "running") else None  # not while it waits
    wall = active_wall(run.started_at, finishes, running_at)
    rate = recent_rate(finishes, running_at)
    eta = counts["queued"] / rate if rate and counts["queued"] and active else None
    return {
        "run_id": run.id,
        "name": run.name,
        "status": run.status,
        "model": run.model,
        "queue": run.queue,
        "decoder": run.decoder,
        "created_at": run.created_at.isoformat(timespec="seconds"),
        "counts": counts,
        "in_flight": int(in_flight),
        "rows_per_s": rate,
        "completion_tokens": int(tokens),
        "prompt_tokens": int(ptoks),
        "forwards": int(forwards),
        "gen_s": float(gen_ms) / 1000,
        "wall_s": wall,
        "tok_s": (tokens / wall) if wall > 0 else None,
        "eta_s": eta,
        "decoders": [
            {
                "decoder": d.decoder or "?",
                "requests": d.requests,
                "tokens": int(d.tokens),
                "forwards": int(d.forwards),
                "gen_s": float(d.gen_ms) / 1000,
                "tok_s": (d.tokens / (d.gen_ms / 1000)) if d.gen_ms else None,
            }
            for d in per_dec
        ],
    }


# ---------------------------------------------------------------------------------------- reports


class Reports(StoreBase):
    """What `canvasq status / runs / results / trace / workers` and the Batch API read."""

    # -- queries ----------------------------------------------------------------------------------
    def get_run(self, run_id: str) -> Run | None:
        with self.Session() as s:
            run = s.get(Run, run_id)
            if run is None:  # accept a unique prefix too
                matches = list(s.scalars(select(Run).where(Run.id.like(f"{run_id}%")).limit(2)))
                run = matches[0] if len(matches) == 1 else None
            return run

    def counts(self, run_id: str) -> dict[str, int]:
        with self.Session() as s:
            rows = s.execute(
                select(Request.status, func.count()).where(Request.run_id == run_id).group_by(Request.status)
            ).all()
        out: dict[str, int] = dict.fromkeys(REQUEST_STATUSES, 0)
        out.update({st: n for st, n in rows})
        out["total"] = sum(n for _, n in rows)
        return out

    def largest_chunk(self, run_id: str) -> int | None:
        """The most rows any chunk of the run holds (a run's chunk size where it was not stored)."""
        with self.Session() as s:
            sizes = select(func.count().label("n")).where(Request.run_id == run_id).group_by(Request.chunk_id)
            return s.scalar(select(func.max(sizes.subquery().c.n)))

    def missing_rows(self, run_id: str, limit: int = 20) -> list[str]:
        """custom_ids of the run's rows not finished yet (queued), in input order."""
        with self.Session() as s:
            return list(
                s.scalars(
                    select(Request.custom_id)
                    .where(Request.run_id == run_id, Request.status == "queued")
                    .order_by(Request.line_no)
                    .limit(limit)
                )
            )

    def row_state(self, run_id: str, custom_id: str) -> tuple[str, Output | None] | None:
        """(request status, its output) of one row, or None when the run has no such row."""
        with self.Session() as s:
            st = s.scalar(
                select(Request.status).where(Request.run_id == run_id, Request.custom_id == custom_id)
            )
            if st is None:
                return None
            return st, s.scalar(select(Output).where(Output.run_id == run_id, Output.custom_id == custom_id))

    def run_summary(self, run_id: str) -> dict[str, Any]:
        """Counts, tokens, forwards and throughput for one run (all from rows)."""
        run = self.get_run(run_id)
        if run is None:
            raise KeyError(run_id)
        return self.run_summaries([run])[run.id]

    def run_summaries(self, runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
        """`run_summary` of each run, by run id, in four queries however many runs (a page of batches)."""
        ids = [r.id for r in runs]
        if not ids:
            return {}
        with self.Session() as s:
            counts: dict[str, dict[str, int]] = {i: dict.fromkeys(REQUEST_STATUSES, 0) for i in ids}
            for run_id, st, n in s.execute(
                select(Request.run_id, Request.status, func.count())
                .where(Request.run_id.in_(ids))
                .group_by(Request.run_id, Request.status)
            ):
                counts[run_id][st] = n
            # one GROUP BY: a run's totals are the sums of its decoders' rows
            per_dec: dict[str, list[Row[*tuple[Any, ...]]]] = {i: [] for i in ids}
            for d in s.execute(
                select(
                    Output.run_id,
                    Output.decoder,
                    func.count().label("requests"),
                    func.coalesce(func.sum(Output.completion_tokens), 0).label("tokens"),
                    func.coalesce(func.sum(Output.prompt_tokens), 0).label("prompt_tokens"),
                    func.coalesce(func.sum(Output.forwards), 0).label("forwards"),
                    func.coalesce(func.sum(Output.gen_ms), 0.0).label("gen_ms"),
                )
                .where(Output.run_id.in_(ids), Output.error_code.is_(None))
                .group_by(Output.run_id, Output.decoder)
                .order_by(Output.run_id, Output.decoder)
            ):
                per_dec[d.run_id].append(d)
            finishes: dict[str, list[datetime]] = {i: [] for i in ids}
            for run_id, at in s.execute(
                select(Output.run_id, Output.updated_at).where(
                    Output.run_id.in_(ids), Output.error_code.is_(None)
                )
            ):
                finishes[run_id].append(at)
            in_flight = dict(
                s.execute(
                    select(Request.run_id, func.count())
                    .select_from(Request)
                    .join(Chunk, Chunk.id == Request.chunk_id)
                    .where(Request.run_id.in_(ids), Request.status == "queued", Chunk.status == "running")
                    .group_by(Request.run_id)
                ).all()
            )
        now = utcnow()
        return {
            r.id: _summary(r, counts[r.id], per_dec[r.id], finishes[r.id], in_flight.get(r.id, 0), now)
            for r in runs
        }

    def list_runs(self, status: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        with self.Session() as s:
            q = select(Run).order_by(Run.created_at.desc(), Run.id).limit(limit)
            if status:
                q = q.where(Run.status == status)
            runs = list(s.scalars(q))
            if not runs:
                return []
            ids = [r.id for r in runs]
            grouped = s.execute(
                select(
                    Request.run_id,
                    func.count(),
                    func.sum(case((Request.status == "done", 1), else_=0)),
                    func.sum(case((Request.status == "errored", 1), else_=0)),
                    func.sum(case((Request.status == "expired", 1), else_=0)),
                    func.sum(case((Request.status == "cancelled", 1), else_=0)),
                    func.sum(case((Request.status == "queued", 1), else_=0)),
                )
                .where(Request.run_id.in_(ids))
                .group_by(Request.run_id)
            ).all()
        by_run = {g[0]: g[1:] for g in grouped}
        out = []
        for r in runs:
            total, done, errored, expired, cancelled, queued = by_run.get(r.id, (0,) * 6)
            out.append(
                {
                    "run_id": r.id,
                    "name": r.name,
                    "status": r.status,
                    "model": r.model,
                    "decoder": r.decoder,
                    "created_at": r.created_at.isoformat(timespec="seconds"),
                    "total": int(total or 0),
                    "done": int(done or 0),
                    "errored": int(errored or 0),
                    "expired": int(expired or 0),
                    "cancelled": int(cancelled or 0),
                    "queued": int(queued or 0),
                }
            )
        return out

    def iter_results(self, run_id: str, ordered: bool = False, batch: int = 1000) -> Iterator[dict[str, Any]]:
        """Terminal rows with their outputs (requests without an output yield an error line)."""
        with self.Session() as s:
            q = (
                select(Request.custom_id, Request.status, Request.line_no, Request.stop, Output)
                .outerjoin(
                    Output, and_(Output.run_id == Request.run_id, Output.custom_id == Request.custom_id)
                )
                .where(Request.run_id == run_id, Request.status.in_(REQUEST_TERMINAL))
            )
            q = q.order_by(Request.line_no) if ordered else q.order_by(Output.updated_at, Request.line_no)
            for cid, status, line_no, stop, out in s.execute(q.execution_options(yield_per=batch)):
                yield {"custom_id": cid, "status": status, "line_no": line_no, "stop": stop, "output": out}

    def traces(self, run_id: str, custom_id: str) -> list[ForwardTraceRow]:
        with self.Session() as s:
            return list(
                s.scalars(
                    select(ForwardTraceRow)
                    .where(ForwardTraceRow.run_id == run_id, ForwardTraceRow.custom_id == custom_id)
                    .order_by(ForwardTraceRow.forward_index)
                )
            )

    def worker_stats(self, offline_after_s: float | None = None) -> list[dict[str, Any]]:
        """Throughput per worker: rows, tokens and generation time from outputs; with
        `offline_after_s`, `online` is whether its last heartbeat is more recent than that, and
        `chunk` the chunk it holds a live lease on."""
        with self.Session() as s:
            rows = s.execute(
                select(
                    Worker.id,
                    Worker.host,
                    Worker.device,
                    Worker.model,
                    Worker.heartbeat_at,
                    func.count(Output.id),
                    func.coalesce(func.sum(Output.completion_tokens), 0),
                    func.coalesce(func.sum(Output.gen_ms), 0.0),
                )
                .outerjoin(Output, Output.worker_id == Worker.id)
                .group_by(Worker.id, Worker.host, Worker.device, Worker.model, Worker.heartbeat_at)
                .order_by(Worker.id)
            ).all()
        now = utcnow()
        with self.Session() as s:
            held = dict(
                s.execute(
                    select(Chunk.worker_id, func.min(Chunk.id))
                    .where(Chunk.status == "running", Chunk.lease_expires_at >= now)
                    .group_by(Chunk.worker_id)
                ).all()
            )
        out = []
        for w, h, d, m, hb, n, t, ms in rows:
            age = (now - hb).total_seconds()
            rec = {
                "worker": w,
                "host": h,
                "device": d,
                "model": m,
                "heartbeat_at": hb.isoformat(timespec="seconds"),
                "last_seen_s": round(age, 1),
                "requests": n,
                "tokens": int(t),
                "tok_s": (t / (ms / 1000)) if ms else None,
            }
            if offline_after_s is not None:
                rec["online"] = age <= offline_after_s
                rec["chunk"] = held.get(w) if rec["online"] else None
            out.append(rec)
        return out
