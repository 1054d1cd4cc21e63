"""PHCD's mechanism counters on fresh testbed problems (CPU, fp32, batch 16, seed 41, n = 32 per task):
plan agreement (committed tokens equal to the coarse plan's last argmax at their position; the
proposal's global-local contradiction rate is 1 − agreement), tokens per commit, forced commits, and
future rows kept vs drawn fresh at each slide (future repair keeps, regeneration would draw).

    python3 benchmarks/phcd_counters.py OUT.json [--n 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks


def counters(bundle, task: str, max_tokens: int, n: int = 32, seed: int = 41) -> dict:
    problems = tasks.generate(task, n, seed)
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems]
    c: Counter = Counter()
    for i in range(0, n, 16):
        for r in run_batch(bundle, DecodeBatch(reqs[i : i + 16], seed=seed), "phcd"):
            c.update({k: v for k, v in r.stats.items() if not k.startswith("first_")})
    out = dict(c)
    out["plan_agreement"] = c["plan_agree"] / max(c["plan_rows"], 1)
    out["tokens_per_commit"] = c["commits"] / max(c["commit_events"], 1)
    out["repaired_share"] = c["repaired_rows"] / max(c["repaired_rows"] + c["fresh_rows"], 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the report (JSON)")
    ap.add_argument("--n", type=int, default=32, help="problems per task")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bundle = load_bundle()
    report = {}
    for task, max_tokens in (("arith", 160), ("code", 160), ("long", 384)):
        report[task] = counters(bundle, task, max_tokens, n=args.n)
        print(task, json.dumps(report[task]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
