"""What a finished row costs the worker's loop to store: `QueueStore.write_results` with one row per
call (each row written as it ends) against the rows of a step together (`--per` rows per call), on a
SQLite file and on PostgreSQL, arms alternating A B B A in one process.

    python3 benchmarks/store_writes.py [--rows 64] [--per 4] [--traces 10] [--reps 2] [--db sqlite,postgresql]

Each row carries `--traces` forward traces (a row's passes) and 64 token ids, as the worker's
records do. Prints per arm the median ms per row over the runs (and every run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _records(ids: list[str], traces: int):
    from canvasq.core.records import ResultRecord

    tr = [
        {
            "forward_index": i,
            "rows": 256,
            "commits": 30,
            "canvases": 1,
            "states": "full",
            "ms": 150.0,
            "kind": "decode",
        }
        for i in range(traces)
    ]
    return [
        ResultRecord(
            c,
            text="x" * 200,
            token_ids=list(range(64)),
            finish_reason="stop",
            prompt_tokens=40,
            completion_tokens=64,
            forwards=traces,
            decoder="official",
            gen_ms=1.0,
            traces=tr,
        )
        for c in ids
    ]


def _one_run(store, rows: int, per: int, traces: int) -> float:
    from canvasq.core.schemas import Job

    jobs = [Job(f"r{i}", "p", "math", 64, None, i + 1) for i in range(rows)]
    run = store.create_run(jobs, model="m", queue="q", decoder="official", chunk_size=rows)
    store.mark_published(run.chunk_ids)
    store.claim_chunk(run.chunk_ids[0], "bench:1", 60, 3)
    recs = _records([j.custom_id for j in jobs], traces)
    t = time.perf_counter()
    for i in range(0, rows, per):
        store.write_results(run.run_id, recs[i : i + per], "bench:1")
    return (time.perf_counter() - t) * 1e3 / rows


def bench(url: str, label: str, args) -> None:
    from canvasq.core.store import Store

    store = Store(url)
    store.upgrade()
    runs: dict[int, list[float]] = {1: [], args.per: []}
    for per in [1, args.per, args.per, 1] * args.reps:
        runs[per].append(_one_run(store, args.rows, per, args.traces))
    store.dispose()
    for per, ms in runs.items():
        each = ", ".join(f"{x:.2f}" for x in ms)
        print(f"{label}: {per} row(s) per write: median {statistics.median(ms):.2f} ms per row ({each})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--per", type=int, default=4, help="rows per write in the batched arm")
    ap.add_argument("--traces", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2, help="A B B A blocks")
    ap.add_argument("--db", default="sqlite,postgresql")
    args = ap.parse_args(argv)
    for db in args.db.split(","):
        if db == "sqlite":
            bench(f"sqlite:///{tempfile.mkdtemp()}/bench.sqlite", "SQLite", args)
        else:
            from tests.harness.backends import fresh_pg_database

            with fresh_pg_database("canvasq_writes") as url:
                bench(url, "PostgreSQL", args)


if __name__ == "__main__":
    main()
