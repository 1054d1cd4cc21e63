"""Cross-chunk feeding A/B through the worker's own loop (`Engine.process_chunk`), one process.

    python3 benchmarks/claim_ahead.py prompts.jsonl --chunk 16 --slots 32 --reps 2 [--device cuda --model M]

The input's lines become one submitted run (chunks of `--chunk`, marked published as a submit marks
them) in a fresh SQLite store per pass; each chunk's message is then delivered in order to one
worker runtime with `decode_slots = --slots`. Arm `off`: each chunk's stream drains before the next
chunk starts. Arm `on` (`CANVASQ_CLAIM_AHEAD=on`): the first delivery claims the later chunks into
its stream; their messages then find nothing to do. Arms alternate ABBA; the first pass is an
untimed warm-up. Prints per pass: wall s, decoder steps, mean slot use, tok/s, and the chunks'
deliveries (each must be 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def jobs_from(path: str):
    """The input's jobs as `canvasq submit` reads them (plain and OpenAI batch lines alike)."""
    from canvasq.core.schemas import Limits, parse_line

    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        job, errors = parse_line(json.loads(line), i, Limits())
        if job is None:
            raise SystemExit(f"{path}:{i}: {'; '.join(errors)}")
        out.append(job)
    return out


def one_pass(bundle, jobs, mode: str, chunk: int, slots: int, device: str) -> dict:
    from sqlalchemy import func, select

    from canvasq.core.settings import Settings
    from canvasq.core.store import Store
    from canvasq.core.tables import Chunk, Output
    from canvasq.worker.engine import Engine

    db = Path(tempfile.mkdtemp()) / "bench.sqlite"
    settings = Settings(
        database_url=f"sqlite:///{db}",
        model=str(bundle.spec),
        device=device,
        decode_slots=slots,
        decode_batch_size=slots,
        claim_ahead=mode,
    )
    store = Store(settings.database_url)
    store.upgrade()
    run = store.create_run(jobs, model=settings.model, queue="q", decoder="official", chunk_size=chunk)
    store.mark_published(run.chunk_ids)
    engine = Engine(settings=settings, store=store, bundle=bundle, worker_id="bench:1", queue="q")
    occ: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    for cid in run.chunk_ids:  # the messages, in the order a queue delivers them
        occ += engine.process_chunk(cid).occupancy
    wall = time.perf_counter() - t0
    with store.Session() as s:
        tokens = s.scalar(select(func.sum(Output.completion_tokens)).where(Output.run_id == run.run_id)) or 0
        deliveries = sorted(set(s.scalars(select(Chunk.attempts).where(Chunk.run_id == run.run_id))))
    store.dispose()
    return {
        "arm": mode,
        "wall_s": round(wall, 2),
        "steps": len(occ),
        "slots_busy": round(sum(n for n, _ in occ) / max(1, sum(s for _, s in occ)), 3),
        "tokens": int(tokens),
        "tok_s": round(tokens / wall, 1),
        "deliveries_per_chunk": deliveries,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    from canvasq.model.loading import load_bundle

    torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, device=args.device)
    jobs = jobs_from(args.prompts)
    one_pass(bundle, jobs[: 2 * args.chunk], "on", args.chunk, args.slots, args.device)  # warm-up
    order = ["off", "on", "on", "off"] * ((args.reps + 1) // 2)
    for mode in order[: 2 * args.reps]:
        r = one_pass(bundle, jobs, mode, args.chunk, args.slots, args.device)
        print(
            json.dumps(
                {**r, "rows": len(jobs), "chunk": args.chunk, "slots": args.slots, "device": args.device}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
