"""Decode-slot occupancy by chunk size, replayed from a real run's forwards per row (label: simulated).

A worker decodes one chunk at a time: its continuous batching refills a free slot from the chunk's
rows, and the next chunk starts only when the last row of this one ends. Given each row's forward
count (the `usage.forwards` of a `canvasq run` output file), this replays that policy step by step
for each slot count and chunk size and prints the mean share of slots busy and the steps needed.

    python3 benchmarks/slot_occupancy.py results.jsonl --slots 8,32 --chunks 16,32,64,128,256,0 --repeat 10

`--chunks 0` is one stream over the whole input (what cross-chunk feeding would give); `--repeat`
cycles the rows to a fleet-sized run. A step's cost is not constant in the rows it carries, so this
gives slot use and step counts, not time.
"""

from __future__ import annotations

import argparse
import json
from collections import deque


def forwards_per_row(path: str) -> list[int]:
    out = []
    with open(path) as fh:
        for line in fh:
            body = (json.loads(line).get("response") or {}).get("body") or {}
            usage = body.get("usage") or {}
            if usage.get("forwards"):
                out.append(int(usage["forwards"]))
    return out


def replay(rows: list[int], slots: int, chunk: int) -> tuple[float, int]:
    """(mean share of slots busy, steps) when rows run `chunk` at a time through `slots` slots."""
    chunk = chunk or len(rows)
    steps = busy = 0
    for start in range(0, len(rows), chunk):
        todo, live = deque(rows[start : start + chunk]), []
        while todo or live:
            while todo and len(live) < slots:
                live.append(todo.popleft())
            steps += 1
            busy += len(live)
            live = [n - 1 for n in live if n > 1]
    return busy / (steps * slots), steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a canvasq run output file (OpenAI batch output lines)")
    ap.add_argument("--slots", default="8,32")
    ap.add_argument("--chunks", default="16,32,64,128,256,0", help="0: the whole input as one stream")
    ap.add_argument("--repeat", type=int, default=1, help="cycle the rows this many times")
    args = ap.parse_args(argv)
    rows = forwards_per_row(args.results) * args.repeat
    print(f"{len(rows)} rows, forwards per row: mean {sum(rows) / len(rows):.2f}, max {max(rows)}")
    print("| slots | chunk | slots busy | steps |\n|---|---|---|---|")
    for slots in (int(x) for x in args.slots.split(",")):
        for chunk in (int(x) for x in args.chunks.split(",")):
            share, steps = replay(rows, slots, chunk)
            print(f"| {slots} | {chunk or 'all'} | {share:.0%} | {steps:,} |")


if __name__ == "__main__":
    main()
