"""Where a traced slice of the service loop leaves the GPU idle, from a torch.profiler Chrome trace.

    python3 benchmarks/trace_gaps.py TRACE.json [--labels decoder_step,encoder_pass,...]

For the slice between the first and last of our labels (`user_annotation` events such as
`decoder_step`, `encoder_pass`, `sample`, `store_rows`), it reports:
- the span, the GPU's busy time (union of kernel, memcpy and memset intervals) and its idle time;
- idle time by the innermost label the host was in meanwhile (`(none)` outside every label: the
  loop between passes), and by the CPU op running then (`aten::item` or
  `cudaStreamSynchronize` there means the host was waiting on the GPU, which had nothing queued);
- per label: host wall time and the GPU time of the kernels it launched (by correlation id).
A label's GPU time well below its wall means its launches, not its kernels, are its cost.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _innermost(spans: list[tuple[float, float, str]], t: float) -> str | None:
    """The shortest span holding t (spans: (start, end, name))."""
    best = None
    for a, b, name in spans:
        if a <= t < b and (best is None or b - a < best[1] - best[0]):
            best = (a, b, name)
    return best[2] if best else None


def _top(d: dict[str, float], n: int = 25) -> dict[str, float]:
    """The n largest entries, µs as ms."""
    return dict(sorted(((k, round(v / 1e3, 2)) for k, v in d.items()), key=lambda kv: -kv[1])[:n])


def analyse(events: list[dict], labels: set[str] | None = None, min_gap_us: float = 20.0) -> dict:
    """The report above, from a Chrome trace's `traceEvents`; times in ms."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    ann = [e for e in xs if e.get("cat") == "user_annotation" and (labels is None or e["name"] in labels)]
    if not ann:
        return {"error": "no labelled host spans in the trace"}
    host_tid = max(
        {(e["pid"], e["tid"]) for e in ann}, key=lambda k: sum(1 for e in ann if (e["pid"], e["tid"]) == k)
    )
    ann = [e for e in ann if (e["pid"], e["tid"]) == host_tid]
    t0 = min(e["ts"] for e in ann)
    t1 = max(e["ts"] + e["dur"] for e in ann)
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ann]
    ops = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in xs
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver") and (e["pid"], e["tid"]) == host_tid
    )
    busy = _union(
        [
            (max(t0, e["ts"]), min(t1, e["ts"] + e["dur"]))
            for e in gpu
            if e["ts"] < t1 and e["ts"] + e["dur"] > t0
        ]
    )
    busy_us = sum(b - a for a, b in busy)
    idle_by_label: dict[str, float] = defaultdict(float)
    idle_by_op: dict[str, float] = defaultdict(float)
    starts = [a for a, _, _ in ops]
    edges = sorted({t for a, b, _ in spans for t in (a, b)})
    prev = t0
    for a, b in busy + [(t1, t1)]:
        if a - prev >= min_gap_us:  # an idle gap, split where the host's labels change
            cuts = [prev] + edges[bisect.bisect_right(edges, prev) : bisect.bisect_left(edges, a)] + [a]
            for x, y in itertools.pairwise(cuts):
                mid = (x + y) / 2
                idle_by_label[_innermost(spans, mid) or "(none)"] += y - x
                i = bisect.bisect_right(starts, mid)
                held = [op for op in ops[max(0, i - 64) : i] if op[0] <= mid < op[1]]
                idle_by_op[min(held, key=lambda op: op[1] - op[0])[2] if held else "(python)"] += y - x
        prev = max(prev, b)
    # GPU time per label: kernels matched to their launch by correlation id (runtime calls, and driver
    # calls: Triton launches through cuLaunchKernelEx)
    launch_at = {
        e["args"]["correlation"]: e["ts"]
        for e in xs
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    per_label: dict[str, dict[str, float]] = defaultdict(lambda: {"wall_ms": 0.0, "gpu_ms": 0.0, "count": 0})
    for a, b, name in spans:
        per_label[name]["wall_ms"] += (b - a) / 1e3
        per_label[name]["count"] += 1
    for e in gpu:
        t = launch_at.get(e.get("args", {}).get("correlation"))
        if t is None or not t0 <= t < t1:
            continue
        name = _innermost(spans, t) or "(none)"
        per_label[name]["gpu_ms"] += e["dur"] / 1e3
    return {
        "span_ms": round((t1 - t0) / 1e3, 2),
        "gpu_busy_ms": round(busy_us / 1e3, 2),
        "gpu_idle_ms": round((t1 - t0 - busy_us) / 1e3, 2),
        "idle_by_label_ms": _top(idle_by_label),
        "idle_by_host_op_ms": _top(idle_by_op),
        "per_label_own": {
            k: {"wall_ms": round(v["wall_ms"], 2), "gpu_ms": round(v["gpu_ms"], 2), "count": v["count"]}
            for k, v in sorted(per_label.items(), key=lambda kv: -kv[1]["wall_ms"])
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--labels", default=None, help="comma-separated label names (default: every annotation)")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    labels = set(args.labels.split(",")) if args.labels else None
    print(json.dumps(analyse(events, labels), indent=1))


if __name__ == "__main__":
    main()
