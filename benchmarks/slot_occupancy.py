"""Decode-slot occupancy by chunk size, replayed from a real run's forwards per row (label: simulated).

A worker decodes one chunk at a time: its continuous batching refills a free slot from the chunk's
rows, and the next chunk starts only when the last row of this one ends. Given each row's forward
count (the `usage.forwards` of a `canvasq run` output file), this replays that policy step by step
for each slot count and chunk size and prints the mean share of slots busy and the steps needed.

    python3 benchmarks/slot_occupancy.py results.jsonl --slots 8,32 --chunks 16,32,64,128,256,0 --repeat 10
    python3 benchmarks/slot_occupancy.py results.jsonl --input prompts.jsonl --slots 32,64 --chunks 128,0

`--chunks 0` is one stream over the whole input (what cross-chunk feeding would give); `--repeat`
cycles the rows to a fleet-sized run. With `--input` (the submitted file, for each row's
`max_tokens`) each chunk is also replayed in the worker's admission order, largest `max_tokens` first
(`canvasq.worker.streams.longest_first`), beside the file's order. A step's cost is not constant in
the rows it carries, so this gives slot use and step counts, not time.
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from typing import NamedTuple

from canvasq.worker.streams import longest_first


def forwards_per_row(path: str) -> list[tuple[str, int]]:
    """(custom_id, forwards) of every decoded row, in the file's order."""
    out = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            body = (rec.get("response") or {}).get("body") or {}
            usage = body.get("usage") or {}
            if usage.get("forwards"):
                out.append((rec.get("custom_id"), int(usage["forwards"])))
    return out


def max_tokens_by_id(path: str) -> dict[str, int]:
    """custom_id -> max_tokens of a submitted file (prompt lines or OpenAI batch lines)."""
    out = {}
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            out[rec["custom_id"]] = int(
                rec.get("max_tokens") or (rec.get("body") or {}).get("max_tokens") or 0
            )
    return out


class Row(NamedTuple):
    max_tokens: int
    forwards: int


def admitted(rows: list[Row], chunk: int) -> list[Row]:
    """Each chunk's rows in the worker's admission order (`longest_first`, the product's own)."""
    chunk = chunk or len(rows)
    return [r for start in range(0, len(rows), chunk) for r in longest_first(rows[start : start + chunk])]


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
    ap.add_argument("--input", help="the submitted file: also replay the largest-max_tokens-first order")
    args = ap.parse_args(argv)
    done = forwards_per_row(args.results) * args.repeat
    rows = [f for _, f in done]
    print(f"{len(rows)} rows, forwards per row: mean {sum(rows) / len(rows):.2f}, max {max(rows)}")
    limits = max_tokens_by_id(args.input) if args.input else None
    if limits is None:
        print("| slots | chunk | slots busy | steps |\n|---|---|---|---|")
    else:
        print(
            "| slots | chunk | slots busy | steps | longest first: busy | steps |\n|---|---|---|---|---|---|"
        )
    for slots in (int(x) for x in args.slots.split(",")):
        for chunk in (int(x) for x in args.chunks.split(",")):
            share, steps = replay(rows, slots, chunk)
            line = f"| {slots} | {chunk or 'all'} | {share:.0%} | {steps:,} |"
            if limits is not None:
                ordered = admitted([Row(limits[cid], f) for cid, f in done], chunk)
                share, steps = replay([r.forwards for r in ordered], slots, chunk)
                line += f" {share:.0%} | {steps:,} |"
            print(line)


if __name__ == "__main__":
    main()
