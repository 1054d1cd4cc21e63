#!/usr/bin/env python
"""Reliability soak: N requests, W workers, a random worker SIGKILLed
every ~K seconds (and restarted, as a supervisor would), one Redis restart mid-run, Redis with a
password (as the compose file runs it), the workers' own periodic reconcile (no sidecar: the
default) → report lost / duplicated rows, statuses, deliveries and worker memory.

Not part of the default test suite (minutes to hours on a CPU box). Run it directly:

    python scripts/soak.py                                   # 2,000 requests, 3 workers, kill every 20 s
    python scripts/soak.py --requests 200 --kill-every 15 --json-out soak.json

Services: a private redis-server on a free port (so the Redis restart disturbs nobody) and a fresh
database on the shared PostgreSQL ($CANVASQ_TEST_PG_URL), or `--db sqlite`. Workers run the testbed
model on CPU. Ends with one JSON line; exit status 1 when anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fault harness lives in tests/harness

from tests.harness.checks import RUN_TERMINAL, collect
from tests.harness.scenario import Scenario


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=20.0, help="mean seconds between worker SIGKILLs")
    ap.add_argument(
        "--redis-restart-at", type=float, default=0.4, help="fraction of rows done at the restart"
    )
    ap.add_argument("--redis-down-s", type=float, default=5.0)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-attempts", type=int, default=6)
    ap.add_argument("--visibility-timeout", type=int, default=90)
    ap.add_argument("--db", choices=("postgresql", "sqlite"), default="postgresql")
    ap.add_argument("--no-redis-auth", action="store_true", help="Redis without a password")
    ap.add_argument("--deadline-s", type=float, default=4 * 3600, help="give up after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)

    t_start = time.monotonic()
    vis = args.visibility_timeout
    with (
        tempfile.TemporaryDirectory(prefix="canvasq-soak-") as tmpd,
        Scenario(
            Path(tmpd),
            db=args.db,
            redis_password=None if args.no_redis_auth else secrets.token_hex(16),
            soft_time_limit=vis - 30,
            hard_time_limit=vis - 15,
            visibility_timeout=vis,
            max_attempts=args.max_attempts,
            decode_batch_size=args.chunk_size,
            chunk_size=args.chunk_size,
        ) as sc,
    ):
        store = sc.store
        ids = sc.write_input(args.requests, prefix="k", max_tokens=args.max_tokens)
        for _ in range(args.workers):
            sc.worker()
        run_id = sc.submit("--chunk-size", str(args.chunk_size), "--name", "soak")
        print(f"soak: run {run_id}, {args.requests} requests, {args.workers} workers", file=sys.stderr)
        kills, redis_restarted = 0, False
        next_kill = time.monotonic() + rnd.expovariate(1 / args.kill_every)
        rss: dict[int, list[int]] = {}  # child pid -> RSS samples (kB)
        last_print = 0.0
        while True:
            now = time.monotonic()
            status = store.run_status(run_id)
            counts = store.counts(run_id)
            finished = counts["total"] - counts["queued"]
            if status in RUN_TERMINAL:
                break
            if now - t_start > args.deadline_s:
                print("soak: deadline reached, giving up", file=sys.stderr)
                break
            live = [w for w in sc.workers if w.alive()]
            for w in live:
                for pid in w.child_pids():
                    kb = rss_kb(pid)
                    if kb:
                        rss.setdefault(pid, []).append(kb)
            if now >= next_kill and live:
                victim = rnd.choice(live)
                victim.kill_all()
                victim.stop()
                kills += 1
                sc.worker()  # a supervisor restarts it
                next_kill = now + rnd.expovariate(1 / args.kill_every)
            if not redis_restarted and finished >= args.redis_restart_at * counts["total"]:
                sc.redis.stop("kill")
                time.sleep(args.redis_down_s)
                sc.redis.start()
                redis_restarted = True
                print(f"soak: redis restarted at {finished}/{counts['total']}", file=sys.stderr)
            if now - last_print > 30:
                print(
                    f"soak: {finished}/{counts['total']} terminal, status {status}, kills {kills}, "
                    f"{now - t_start:.0f}s",
                    file=sys.stderr,
                )
                last_print = now
            time.sleep(1.0)

        rep = collect(store, run_id, ids)
        attempts = Counter(rep.attempts.values())
        # T19: a child that lived long enough (≥ 30 one-second samples) must not keep growing after
        # its model is loaded: compare the middle of its life with its end.
        long_lived = {pid: xs for pid, xs in rss.items() if len(xs) >= 30}
        growth = {pid: (xs[len(xs) // 2], xs[-1]) for pid, xs in long_lived.items()}
        growth_max = max((b / a for a, b in growth.values()), default=None)
        result = {
            "requests": args.requests,
            "workers": args.workers,
            "kill_every_s": args.kill_every,
            "kills": kills,
            "redis_restarts": int(redis_restarted),
            "run_status": rep.run_status,
            "statuses": rep.statuses,
            "error_codes": rep.error_codes,
            "lost": len(rep.lost),
            "duplicated": len(rep.duplicated),
            "unknown": len(rep.unknown),
            "not_terminal": len(rep.not_terminal),
            "ok": rep.ok,
            "deliveries_per_chunk": {str(k): v for k, v in sorted(attempts.items())},
            "max_child_rss_mb": round(max((max(s) for s in rss.values()), default=0) / 1024, 1),
            "rss_mb_mid_vs_last": {
                str(pid): [round(a / 1024, 1), round(b / 1024, 1)] for pid, (a, b) in growth.items()
            },
            "rss_growth_max": round(growth_max, 3) if growth_max else None,
            "wall_s": round(time.monotonic() - t_start, 1),
            "db": args.db,
        }
        line = json.dumps(result)
        if args.json_out:
            Path(args.json_out).write_text(line + "\n")
        print(line)
        return 0 if rep.ok and rep.run_status == "completed" else 1  # ok: nothing lost or duplicated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
