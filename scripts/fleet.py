#!/usr/bin/env python
"""A fleet on one host: one `canvasq worker` per GPU (each pinned by CUDA_VISIBLE_DEVICES), a private
Redis, the store in SQLite (a host without PostgreSQL) or on PostgreSQL, and one run drained by all
of them. Measures what a multi-GPU rollout needs: the time for every worker to become ready, committed
tok/s per worker and in total for each worker count of `--scaling` (the same input each time, a
fresh store and Redis per count), and failover (`--kill-one`: one worker SIGKILLed a third of the way
through the largest count's run; the others finish it, every custom_id exactly once).

    # on a machine with 8 GPUs: testbed schedules replayed on real-shape random weights (W4, graphs)
    python scripts/fleet.py --model random:26b-a4b --record 64 --requests 2000 --scaling 1,2,4,8 --kill-one
    # the trained testbed itself (real schedules, accuracy-bearing outputs)
    python scripts/fleet.py --requests 2000 --scaling 1,8 --kill-one
    # a dry run on CPU: two workers, no GPU
    python scripts/fleet.py --cpu 2 --requests 24 --max-tokens 32 --scaling 1,2 --kill-one

`--record N` decodes N arith + N code testbed problems with the official sampler first (on GPU 0, or
the CPU) and hands the workers the recorded steps per canvas (CANVASQ_TEST_REPLAY): random weights
never converge, so each request then runs its recorded schedule (label such figures "replayed").
Needs `redis-server` on PATH (a GPU image without one: carry Debian's redis-server package). Ends
with one JSON line; exit status 1 when any run lost or duplicated a row or did not complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives in tests/harness, the recorder in benchmarks/

from tests.harness.checks import collect
from tests.harness.scenario import Scenario


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def write_inputs(
    path: Path, n: int, max_tokens: int, recorded: list[dict] | None, scale: int
) -> tuple[list, dict]:
    """`n` request lines (and the replay table when `recorded`): recorded problems cycled, their
    prompts repeated `scale` times and max_tokens = recorded canvases x the real canvas (256)."""
    from canvasq.testbed import tasks

    lines, replay = [], {}
    if recorded:
        for i in range(n):
            r = recorded[i % len(recorded)]
            cid = f"f{i:05d}"
            replay[cid] = r["steps"]
            lines.append(
                {
                    "custom_id": cid,
                    "prompt": " ".join([r["prompt"]] * scale),
                    "task": r["task"],
                    "max_tokens": len(r["steps"]) * 256,
                }
            )
    else:
        half = (n + 1) // 2
        for task, family in (("arith", "math"), ("code", "code")):
            for p in tasks.generate(task, half, 7):
                lines.append(
                    {
                        "custom_id": f"f{len(lines):05d}",
                        "prompt": p.prompt,
                        "task": family,
                        "max_tokens": max_tokens,
                    }
                )
        lines = lines[:n]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [x["custom_id"] for x in lines], replay


def worker_extra(i: int, args, replay_path: Path | None) -> dict[str, str]:
    extra = {
        "CANVASQ_RECONCILE_S": "5",
        "CANVASQ_LEASE_S": str(args.lease_s),
        "CANVASQ_CLAIM_AHEAD": args.claim_ahead,
    }
    if args.cpu:
        extra["CANVASQ_DEVICE"] = "cpu"
    else:
        extra.update(
            {
                "CUDA_VISIBLE_DEVICES": str(i),
                "CANVASQ_DEVICE": "cuda",
                "CANVASQ_TORCH_THREADS": "4",
                "OMP_NUM_THREADS": "4",
            }
        )
    if replay_path is not None:
        extra["CANVASQ_TEST_REPLAY"] = str(replay_path)
    if os.environ.get(
        "CANVASQ_TEST_DELAY_S"
    ):  # the dry run's test: rows fed slowly, so the kill lands mid-run
        extra["CANVASQ_TEST_DELAY_S"] = os.environ["CANVASQ_TEST_DELAY_S"]
    return extra


def tokens_by_worker(store, run_id: str) -> dict[str, int]:
    from sqlalchemy import func, select

    from canvasq.core.tables import Output

    with store.Session() as s:
        rows = s.execute(
            select(Output.worker_id, func.sum(Output.completion_tokens))
            .where(Output.run_id == run_id, Output.error_code.is_(None))
            .group_by(Output.worker_id)
        ).all()
    return {str(w): int(t or 0) for w, t in rows}


def one_count(
    k: int, args, tmp: Path, ids: list[str], input_path: Path, replay_path: Path | None, kill: bool
) -> dict:
    """Start k workers, time their readiness, drain one run; with `kill`, SIGKILL worker 0 mid-run."""
    vis = args.visibility_timeout
    with Scenario(
        tmp / f"k{k}",
        db=args.db,
        model=args.model,
        soft_time_limit=vis - 60,
        hard_time_limit=vis - 30,
        visibility_timeout=vis,
        max_attempts=3,
        decode_batch_size=args.chunk_size,
        chunk_size=args.chunk_size,
    ) as sc:
        t0 = time.monotonic()
        workers = [sc.worker(extra=worker_extra(i, args, replay_path)) for i in range(k)]
        ready = []
        for w in workers:
            w.wait_ready(deadline_s=args.ready_deadline_s)
            ready.append(round(time.monotonic() - t0, 1))
        t_submit = time.monotonic()
        run = sc.submit("--chunk-size", str(args.chunk_size), "--name", f"fleet-{k}", path=input_path)
        killed = None
        while sc.status(run) not in ("completed", "cancelled", "expired"):
            if time.monotonic() - t_submit > args.deadline_s:
                break
            c = sc.store.counts(run)
            if kill and killed is None and c["total"] - c["queued"] >= c["total"] / 3:
                workers[0].kill_all()
                killed = round(time.monotonic() - t_submit, 1)
                print(
                    f"fleet: k={k} SIGKILLed worker 0 at {c['total'] - c['queued']}/{c['total']}",
                    file=sys.stderr,
                )
            time.sleep(0.1)  # a small run can end within a few polls: a slower one missed the third
        wall = time.monotonic() - t_submit
        rep = collect(sc.store, run, ids)
        per_worker = tokens_by_worker(sc.store, run)
        total = sum(per_worker.values())
        return {
            "workers": k,
            "ready_s": ready,
            "run_status": rep.run_status,
            "wall_s": round(wall, 1),
            "tokens": total,
            "tok_s": round(total / wall, 1),
            "tok_s_per_worker": {w: round(t / wall, 1) for w, t in sorted(per_worker.items())},
            "killed_at_s": killed,
            "redelivered_chunks": sum(a > 1 for a in rep.attempts.values()),
            "lost": len(rep.lost),
            "duplicated": len(rep.duplicated),
            "statuses": rep.statuses,
            "ok": rep.ok and rep.run_status == "completed",
        }


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu", type=int, default=0, metavar="N", help="N workers on the CPU (a dry run, no GPU)"
    )
    ap.add_argument("--model", default=None, help="worker model (default: the testbed)")
    ap.add_argument(
        "--record",
        type=int,
        default=0,
        metavar="N",
        help="record N arith + N code testbed schedules and replay them (for random weights)",
    )
    ap.add_argument("--scale", type=int, default=8, help="prompt repeats with --record (real-shape lengths)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=128, help="without --record")
    ap.add_argument("--scaling", default=None, help="worker counts, e.g. 1,2,4,8 (default: all, once)")
    ap.add_argument("--kill-one", action="store_true", help="SIGKILL one worker mid-run at the largest count")
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument(
        "--claim-ahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="CANVASQ_CLAIM_AHEAD for the workers (auto: on for GPU workers)",
    )
    ap.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--visibility-timeout", type=int, default=3600)
    ap.add_argument(
        "--lease-s",
        type=int,
        default=60,
        help="chunk lease: a killed worker's chunk is re-published after it",
    )
    ap.add_argument("--ready-deadline-s", type=float, default=1200)
    ap.add_argument("--deadline-s", type=float, default=3 * 3600)
    ap.add_argument("--json-out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    n_max = args.cpu or visible_gpus()
    if not n_max:
        raise SystemExit("fleet: no CUDA device visible; --cpu N runs N workers on the CPU")
    counts = [int(x) for x in args.scaling.split(",")] if args.scaling else [n_max]
    if max(counts) > n_max:
        raise SystemExit(f"fleet: --scaling asks for {max(counts)} workers; {n_max} available")
    recorded = None
    if args.record:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from official_service import record

        recorded, accuracy = record("cuda" if not args.cpu else "cpu", args.record, 0, 160)
        print(f"fleet: recorded {len(recorded)} schedules, accuracy {accuracy}", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="canvasq-fleet-") as tmpd:
        tmp = Path(tmpd)
        input_path = tmp / "input.jsonl"
        ids, replay = write_inputs(input_path, args.requests, args.max_tokens, recorded, args.scale)
        replay_path = None
        if replay:
            replay_path = tmp / "replay.json"
            replay_path.write_text(json.dumps(replay))
        for k in counts:
            r = one_count(k, args, tmp, ids, input_path, replay_path, kill=args.kill_one and k == max(counts))
            print(f"fleet: {json.dumps(r)}", file=sys.stderr)
            results.append(r)
    base = next((r["tok_s"] for r in results if r["workers"] == 1 and not r["killed_at_s"]), None)
    for r in results:
        r["scaling_efficiency"] = round(r["tok_s"] / (r["workers"] * base), 3) if base else None
    out = {
        "host_workers": n_max,
        "device": "cpu" if args.cpu else "cuda",
        "model": args.model or "testbed",
        "claim_ahead": args.claim_ahead,
        "replayed": bool(recorded),
        "requests": args.requests,
        "chunk_size": args.chunk_size,
        "db": args.db,
        "commit": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(),
        "runs": results,
    }
    line = json.dumps(out)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
