"""Issue 36's overhead bar read from a `structured_output.py` report: each constrained arm's tok/s against
the mean of the free runs on either side of it in run order (the nearest free arm before it and the
nearest after it, in its round), then the median over rounds for each arm's name.

A testbed step on a GPU is bound by its host, and H100 hosts moved by up to 1.6x within one process
(the same free stream 1.12 to 1.82 s): read against free runs several arms away, a constrained arm takes
on that drift. With `--free-each` every schema's arm has a free run just before it, and the next
schema's (or `--free-last`'s) just after it.

    python3 benchmarks/overhead_ratios.py overhead.json    # a line per round, the medians, the best runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _parse(arm: str) -> tuple[str | None, str]:
    """(the arm's name with its knobs, None for a free run; its round's label: seeds and round)."""
    head, _, seeds = arm.partition("/seed")
    label = "seed" + seeds
    if head.startswith("free/") or head == "free_last":
        return None, label
    return head, label


def _read(arms: list[dict]):
    """(name or None for a free run, round label, tok/s) of each arm but the `prompt_only` ones."""
    for a in arms:
        name, label = _parse(a["arm"])
        if name is None or not name.startswith("prompt_only/"):
            yield name, label, a["tok_s"]


def bracketed(arms: list[dict]) -> dict[str, dict[str, float]]:
    """{round label: {arm name: tok/s ratio - 1}}, each constrained arm against the mean of its round's
    nearest free arms before and after it (one of them when it has no other); `prompt_only` arms are
    not read."""
    rounds: dict[str, list[tuple[str | None, float]]] = defaultdict(list)
    for name, label, tok in _read(arms):
        rounds[label].append((name, tok))
    out: dict[str, dict[str, float]] = {}
    for label, seq in rounds.items():
        out[label] = {}
        for k, (name, tok) in enumerate(seq):
            if name is None:
                continue
            before = next((t for n, t in reversed(seq[:k]) if n is None), None)
            after = next((t for n, t in seq[k + 1 :] if n is None), None)
            refs = [t for t in (before, after) if t is not None]
            if refs:
                out[label][name] = tok / statistics.mean(refs) - 1
    return out


def medians(by_round: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each arm name's median ratio over the rounds."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for arms in by_round.values():
        for name, r in arms.items():
            ratios[name].append(r)
    return {name: statistics.median(rs) for name, rs in ratios.items()}


def best_of(arms: list[dict]) -> dict[str, float]:
    """Each arm name's best tok/s over its rounds against the free runs' best: a host's slow spells only
    ever take time away, so the two fastest runs are the least disturbed (what `timeit` reads)."""
    best: dict[str | None, float] = defaultdict(float)
    for name, _, tok in _read(arms):
        best[name] = max(best[name], tok)
    free = best.pop(None, 0.0)
    return {str(name): tok / free - 1 for name, tok in best.items()} if free else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="structured_output.py's --out")
    arms = json.loads(Path(ap.parse_args().report).read_text())["arms"]
    by_round = bracketed(arms)
    for label, ratios in by_round.items():
        print(f"{label.rpartition('/')[2]}: " + "; ".join(f"{n} {r:+.1%}" for n, r in ratios.items()))
    print("median vs free: " + "; ".join(f"{n} {r:+.1%}" for n, r in medians(by_round).items()))
    print("best vs free's best: " + "; ".join(f"{n} {r:+.1%}" for n, r in best_of(arms).items()))


if __name__ == "__main__":
    main()
