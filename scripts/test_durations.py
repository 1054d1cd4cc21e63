"""Refresh `tests/durations.tsv`, the per-test seconds `tests/conftest.py` balances xdist's blocks with,
from a run with CANVASQ_TEST_CPU set (its "cpu, start, end, worker, nodeid" lines):

    CANVASQ_TEST_CPU=/tmp/t.tsv python3 -m pytest -q -p no:cacheprovider -n 6 --dist worksteal
    python3 scripts/test_durations.py /tmp/t.tsv

Wall seconds per test (setup, call and teardown), tests of at least MIN_S only (the rest count as
conftest's defaults), largest first."""

from __future__ import annotations

import sys
from pathlib import Path

MIN_S = 0.5
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.tsv"


def main(src: str) -> None:
    seconds: dict[str, float] = {}
    for line in Path(src).read_text().splitlines():
        _cpu, start, end, _worker, node = line.split("\t", 4)
        seconds[node] = float(end) - float(start)
    kept = sorted(((s, n) for n, s in seconds.items() if s >= MIN_S), reverse=True)
    OUT.write_text("".join(f"{s:.1f}\t{n}\n" for s, n in kept))
    print(f"{len(kept)} of {len(seconds)} tests written to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
