"""Shared benchmark plumbing: interpreter switch, timing, measured bandwidth, report output.

Import this module first: on a machine without a GPU it sets TRITON_INTERPRET=1 before any Triton
kernel is defined, so `--quick` runs the real kernels on CPU at tiny shapes.
"""

from __future__ import annotations

import itertools
import json
import os
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


def time_ms(fn, rotate: int = 1, graph: bool = False) -> float:
    """Median ms per call of `fn(i % rotate)`, i counting the calls (rotate inputs so no call finds the
    previous one's data in cache).

    GPU: `triton.testing.do_bench` (an event pair per call, L2 flushed between calls), or with
    graph=True `do_bench_cudagraph` (the calls replayed from one CUDA graph: for kernels shorter than
    their own launch). CPU (interpreter smoke runs): torch's `benchmark.Timer` over a few calls.
    """
    calls = itertools.count()

    def call():
        return fn(next(calls) % rotate)

    if ON_GPU:
        import triton.testing

        bench = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
        return bench(call, return_mode="median")
    from torch.utils import benchmark

    call()  # first call compiles / interprets once
    return benchmark.Timer("call()", globals={"call": call}).timeit(2).median * 1e3


def measured_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth, counting read + write (~4.2 TB/s on an H200)."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda _: dst.copy_(src))
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
