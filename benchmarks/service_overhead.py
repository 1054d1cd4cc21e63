"""Queue + store overhead against plain generation, same process, same model, same batches.

Arms (run in ABBA order, seed reset per arm):
  plain    tokenise → DecodeBatch → run_batch, results kept in memory (the denominator)
  service  the whole service path minus process boundaries: validate the JSONL, store run + request
           rows (SQL), publish chunk messages to a fresh Redis queue, consume them one at a time,
           claim each chunk in SQL, decode through Engine, upsert outputs + traces, finalise
           the run, export results JSONL

overhead = (service wall − plain wall) / plain wall, summed over both repetitions of each arm; and,
robust to a noisy machine, the service arm's time outside run_batch as a share of its time inside.
Hardware, model, decoder and n are printed; the commit schedule is real (the model decodes).

    python benchmarks/service_overhead.py --n 1000 --max-tokens 32 --decoder official
    python benchmarks/service_overhead.py --n 1000 --device cuda --db postgresql+psycopg://...

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness: the test Redis queue helpers


def write_input(path: Path, n: int, max_tokens: int, seed: int) -> None:
    from canvasq.testbed import tasks

    math, code = tasks.generate("arith", (n + 1) // 2, seed), tasks.generate("code", n // 2, seed)
    with open(path, "w") as fh:
        for i in range(n):
            task, p = ("math", math[i // 2]) if i % 2 == 0 else ("code", code[i // 2])
            fh.write(
                json.dumps(
                    {"custom_id": f"r{i:05d}", "prompt": p.prompt, "task": task, "max_tokens": max_tokens}
                )
                + "\n"
            )


def arm_plain(bundle, settings, path: Path, decoder: str) -> dict:
    from canvasq.core.schemas import Limits, iter_jobs
    from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch

    t0 = time.perf_counter()
    jobs = list(iter_jobs(path, Limits.for_model(settings)))
    tokens = 0
    bs = settings.decode_batch_size
    for i in range(0, len(jobs), bs):
        reqs = [
            DecodeRequest(j.custom_id, bundle.encode_prompt(j.prompt, j.task), j.max_tokens, j.task)
            for j in jobs[i : i + bs]
        ]
        for r in run_batch(bundle, DecodeBatch(reqs, seed=settings.seed), decoder):
            tokens += len(r.token_ids)
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "requests": len(jobs)}


def arm_service(bundle, settings, path: Path, decoder: str, db_url: str, redis_url: str) -> dict:
    from kombu import Connection

    from canvasq.core.results import write_results
    from canvasq.core.schemas import Limits, iter_jobs, validate_file
    from canvasq.core.store import Store
    from canvasq.worker.celery_app import publish_chunks
    from canvasq.worker.engine import Engine
    from tests.harness.backends import unique_queue

    settings = settings.model_copy(update={"database_url": db_url, "broker_url": redis_url})
    store = Store(db_url)
    store.upgrade()
    queue = unique_queue("canvasq.bench")
    t0 = time.perf_counter()
    limits = Limits.for_model(settings)
    report = validate_file(path, limits)
    assert report.ok, report.summary()
    created = store.create_run(
        iter_jobs(path, limits),
        model=settings.model,
        queue=queue,
        decoder=decoder,
        chunk_size=settings.decode_batch_size,
    )
    publish_chunks(created.chunk_ids, queue, settings)
    store.mark_published(created.chunk_ids)
    from canvasq.decoders import run_batch

    decode_s = [0.0]

    def timed_decode(*a, **k):  # generation time inside the service path, to separate out the rest
        t = time.perf_counter()
        try:
            return run_batch(*a, **k)
        finally:
            decode_s[0] += time.perf_counter() - t

    engine = Engine(
        settings=settings,
        store=store,
        bundle=bundle,
        worker_id="bench:1",
        queue=queue,
        decode_fn=timed_decode,
    )
    done = 0
    with Connection(redis_url) as conn:
        q = conn.SimpleQueue(queue)
        while done < len(created.chunk_ids):
            msg = q.get(block=True, timeout=30)
            chunk_id = msg.payload[0][0]  # Celery protocol 2 body: (args, kwargs, embed)
            engine.process_chunk(chunk_id)
            msg.ack()
            done += 1
        q.close()
    run = store.get_run(created.run_id)
    buf = io.StringIO()
    n_ok, n_err = write_results(store, run, buf)
    wall = time.perf_counter() - t0
    summary = store.run_summary(created.run_id)
    store.dispose()
    return {
        "wall_s": wall,
        "tokens": summary["completion_tokens"],
        "requests": n_ok + n_err,
        "errors": n_err,
        "status": summary["status"],
        "decode_s": decode_s[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--decoder", default="official")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=25, help="prompts per DecodeBatch (= chunk size)")
    ap.add_argument("--db", default=None, help="store URL (default: a fresh SQLite file)")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", default="ABBA", help="A = plain, B = service")
    args = ap.parse_args()

    import torch

    from canvasq.core.settings import get_settings
    from canvasq.model.loading import load_bundle

    settings = get_settings().model_copy(
        update={
            "decode_batch_size": args.batch,
            "seed": args.seed,
            **({"model": args.model} if args.model else {}),
        }
    )
    bundle = load_bundle(settings.model, device=args.device)
    tmp = Path(tempfile.mkdtemp(prefix="canvasq-bench-"))
    path = tmp / "in.jsonl"
    write_input(path, args.n, args.max_tokens, args.seed)
    arm_plain(bundle, settings, path, args.decoder) if args.n >= 2 else None  # warm-up (not counted)

    results: dict[str, list[dict]] = {"plain": [], "service": []}
    for k, arm in enumerate(args.order):
        if arm == "A":
            results["plain"].append(arm_plain(bundle, settings, path, args.decoder))
        else:
            db = args.db or f"sqlite:///{tmp / f'bench{k}.sqlite'}"
            results["service"].append(arm_service(bundle, settings, path, args.decoder, db, args.redis))
        r = results["plain" if arm == "A" else "service"][-1]
        print(
            f"  {['plain', 'service'][arm == 'B']:8s} {r['requests']:6d} req  {r['tokens']:8d} tok  "
            f"{r['wall_s']:8.1f} s",
            flush=True,
        )

    plain_s = sum(r["wall_s"] for r in results["plain"])
    service_s = sum(r["wall_s"] for r in results["service"])
    overhead = (service_s - plain_s) / plain_s * 100 if plain_s else float("nan")
    # Contention-robust view: everything the service arm did outside run_batch, against run_batch.
    svc_decode = sum(r["decode_s"] for r in results["service"])
    direct = (service_s - svc_decode) / svc_decode * 100 if svc_decode else float("nan")
    hw = (
        torch.cuda.get_device_name(0)
        if args.device.startswith("cuda")
        else f"CPU {platform.processor() or platform.machine()}"
    )
    print()
    print(f"{'arm':8s} {'runs':>4s} {'wall s':>9s} {'tokens':>9s} {'tok/s':>8s}")
    for name, rs in results.items():
        w, t = sum(r["wall_s"] for r in rs), sum(r["tokens"] for r in rs)
        print(f"{name:8s} {len(rs):4d} {w:9.1f} {t:9d} {t / w if w else 0:8.1f}")
    print(
        f"service overhead vs plain generation: {overhead:+.2f}%  (n={args.n}, order {args.order}, "
        f"decoder {args.decoder}, model {settings.model}, {hw}, commit schedule real)"
    )
    print(
        f"service time outside generation (queue, store, validation, tokenising, export): "
        f"{service_s - svc_decode:.2f} s = {direct:+.2f}% of the {svc_decode:.1f} s spent in run_batch"
    )
    print(
        json.dumps(
            {
                "bench": "service_overhead",
                "n": args.n,
                "max_tokens": args.max_tokens,
                "decoder": args.decoder,
                "model": settings.model,
                "device": args.device,
                "hardware": hw,
                "order": args.order,
                "plain_s": round(plain_s, 3),
                "service_s": round(service_s, 3),
                "overhead_pct": round(overhead, 3),
                "outside_generation_s": round(service_s - svc_decode, 3),
                "outside_generation_pct": round(direct, 3),
                "store": args.db or "sqlite",
                "schedule": "real",
            }
        )
    )


if __name__ == "__main__":
    main()
