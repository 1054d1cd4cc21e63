"""Shared benchmark plumbing: interpreter switch, timing, measured bandwidth, report output.

Import this module first: on a machine without a GPU it sets TRITON_INTERPRET=1 before any Triton
kernel is defined, so `--quick` runs the real kernels on CPU at tiny shapes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def time_ms(fn, iters: int = 50, warmup: int = 10, rotate: int = 1) -> float:
    """Median ms of `fn(i % rotate)` over `iters` calls after `warmup`.

    On the GPU: a CUDA event pair around each call, all calls queued back to back and one synchronise
    at the end, so the host runs ahead and each pair times the GPU's work, not the launch. (Until
    2026-11-30 the loop synchronised after every call: each sample then also held the host's launch
    latency, about 60 us per W4 MoE kernel, which made the tuner pick tiles that were slower on the GPU.)
    """
    for i in range(warmup):
        fn(i % rotate)
    sync()
    if ON_GPU:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for i, (a, b) in enumerate(events):
            a.record()
            fn(i % rotate)
            b.record()
        events[-1][1].synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events)
    samples = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i % rotate)
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def measured_bandwidth_gbs(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device copy bandwidth, counting read + write (PERF.md's convention: ~4.2 TB/s on an H200)."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda _: dst.copy_(src), iters=iters, warmup=3)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def device_info() -> dict:
    info = {
        "device": torch.cuda.get_device_name() if ON_GPU else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    from canvasq.provenance import git_commit

    info["commit"] = git_commit()
    return info


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def report(name: str, rows: list[dict], cols: list[str], summary: dict) -> None:
    """Print the table, write raw results under $OUT if set, end with one JSON line."""
    print(markdown_table(rows, cols))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
        (Path(out) / f"{name}.md").write_text(markdown_table(rows, cols) + "\n")
    print(json.dumps({"bench": name, **summary}))
    sys.stdout.flush()
