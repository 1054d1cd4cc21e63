"""Issue 35, item 1: the per-(task, seed) `canvasq bench` reports under one directory pooled per arm
(accuracy, forwards per request, rows per forward, G/τ), overall and per task, with the difference
against a baseline arm on the same problems (± 1.96 standard errors, unpaired: an upper bound).

    python3 benchmarks/i35_front_table.py benchmarks/results/cpu_2026-12-03_i35_front_revise
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

FIELDS = ("n", "correct", "tokens", "fwd_req", "rows")


def pooled(root: Path) -> tuple[dict, list[tuple]]:
    """arm -> task ("all" too) -> summed counts, and each block's (task, seed, commit)."""
    sums: dict = defaultdict(lambda: defaultdict(lambda: dict.fromkeys(FIELDS, 0)))
    blocks = []
    for f in sorted(root.glob("*/bench.json")):
        rep = json.loads(f.read_text())
        blocks.append((rep["tasks"], rep["seeds"], rep["commit"], rep["n"]))
        for arm in rep["arms"]:
            for task, v in arm["per_task"].items():
                for key in ("all", task):
                    for k in FIELDS:
                        sums[arm["arm"]][key][k] += v[k]
    return sums, blocks


def _row(arm: str, per: dict, base: dict) -> str:
    def acc(d):
        return d["correct"] / d["n"] if d["n"] else float("nan")

    t, a, b = per["all"], acc(per["all"]), acc(base)
    se = math.sqrt(a * (1 - a) / t["n"] + b * (1 - b) / base["n"])
    cells = [arm, str(t["n"]), f"{100 * a:.1f} %"]
    cells += [f"{100 * acc(per[k]):.1f} %" for k in ("arith", "code")]
    cells.append(f"{100 * (a - b):+.1f} ± {196 * se:.1f}")
    cells += [f"{per[k]['fwd_req'] / max(per[k]['n'], 1):.2f}" for k in ("all", "arith", "code")]
    cells += [f"{t['rows'] / t['fwd_req']:.1f}", f"{t['rows'] / t['tokens']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main(root: str, baseline: str = "official") -> None:
    sums, blocks = pooled(Path(root))
    print(f"blocks (tasks, seeds, commit, n): {blocks}")
    print(
        "| arm | n | accuracy | arith | code | vs baseline (points) | forwards / request | arith | code "
        "| rows / forward | G/τ |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, per in sums.items():
        print(_row(arm, per, sums[baseline]["all"]))


if __name__ == "__main__":
    main(*sys.argv[1:])
