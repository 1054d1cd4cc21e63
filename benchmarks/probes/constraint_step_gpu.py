"""GPU probe: the host's cost of one constrained step's hooks at the testbed's 64-slot stream, apart
from the stream around them, so a change to them is measured in µs rather than through the
structured-output probe's whole-arm tok/s (whose rounds move by ±5 %).

The official decoder's `CanvasConstraints` as the product configures it, 45 of 64 slots holding rows
under `answer_totals` that think first (the overhead probe's worst schema; begun as a stream begins
them), random logits [64, C, V] on the device. Per call, host µs from the call to its return with the
device idle before it (a testbed step is bound by its host: what the device does after the return is
not on the step's path): `mask` over the 64 rows, split into its parts by `benchmarks/phases.py`;
`final` for 2 stopped canvases (their one host read); `begin` of one canvas; the output check of one
document. Each row's state is restored after `final`, so every call sees the same step.

    python benchmarks/probes/constraint_step_gpu.py              # H100 / H200 (the kernels' path)
    python benchmarks/probes/constraint_step_gpu.py --quick      # CPU: the torch path, a few calls
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks.phases

from benchmarks.phases import PhaseClock
from canvasq.decoders import make_decoder
from canvasq.model.loading import load_bundle
from canvasq.testbed.json_adapter import FORM_SCHEMAS

SCHEMA = FORM_SCHEMAS["answer_totals"]
SLOTS, ROWS, STOPPED = 64, 45, 2  # the overhead probe's stream: 64 slots, ~0.7 of them constrained


def stream(dec, rows: int):
    """`rows` constrained rows in slots 0..rows-1 of a 64-row group (the rest free), each begun."""
    cc, seqs = dec.constraints, []
    for k in range(SLOTS):
        schema = SCHEMA if k < rows else None
        req = SimpleNamespace(think=True, max_tokens=7 * dec.C, response_format=schema)
        s = SimpleNamespace(row=k, slot=k, req=req, stats=Counter(), canvases=[SimpleNamespace(index=0)])
        s.done, s.error = False, None
        cc.begin(s, s.canvases[0])
        seqs.append(s)
    return seqs


def host_us(call, n: int, done: bool = False) -> list[float]:
    """Host µs of each of `n` calls (after 3 warm-ups), the device synchronised before each; `done`:
    to the call's device work done instead (the step's critical path when nothing else is queued)."""
    out = []
    for i in range(n + 3):
        C.sync()
        t0 = time.perf_counter()
        call()
        if done:
            C.sync()
        if i >= 3:
            out.append((time.perf_counter() - t0) * 1e6)
    C.sync()
    return out


def device_us(call, n: int) -> dict[str, float]:
    """Device µs a call of each kernel `call` launches (a profiler over `n` calls after the timed ones):
    the Viterbi's one launch is a large share of a constrained stream's device time (BENCHMARKS.md),
    and the step's one sync waits for what the hooks queue. Empty without CUDA."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    call()
    C.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        C.sync()
    per = Counter()
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            per[ev.key[:60]] += ev.device_time_total / n
    return {k: round(v, 1) for k, v in per.most_common(12)}


def host_profile(call, n: int, top: int = 25) -> dict:
    """`call`'s host µs a call by Python function (cProfile's own time, the top `top`) and by torch op
    (the profiler's CPU self time, CPU activity only), each over `n` calls, printed and returned."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    C.sync()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim, own s, cumulative s, ...)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    funcs = {
        f"{Path(k[0]).name}:{k[1]} {k[2]}": (round(1e6 * v[2] / n, 1), round(v[0] / n, 1)) for k, v in rows
    }
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(n):
            call()
    ops = Counter()
    for ev in tp.key_averages():
        ops[ev.key[:60]] += ev.self_cpu_time_total / n
    op_rows = {k: round(v, 1) for k, v in ops.most_common(top)}
    print(
        "mask's host µs a call by function (own time; calls a call): "
        + ", ".join(f"{k} {v}" for k, v in funcs.items())
    )
    print(
        "mask's host µs a call by torch op (self CPU): " + ", ".join(f"{k} {v}" for k, v in op_rows.items())
    )
    return {"host_functions_us": funcs, "host_ops_us": op_rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few calls (on CPU: the torch path)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="also (always with --quick) `mask`'s host time by Python function (cProfile, own time) and by torch op (the "
        "profiler's CPU self time): where its host µs go beyond the parts",
    )
    a = ap.parse_args()
    n = 3 if a.quick else a.calls
    dev = C.DEVICE
    dec = make_decoder("official", load_bundle(device=dev), {"cuda_graphs": "off"})
    cc, Cn, V = dec.constraints, dec.C, dec.V
    seqs = stream(dec, ROWS)
    logits = torch.randn(SLOTS, Cn, V, device=dev) * 3
    work = logits.clone()

    def mask():
        work.copy_(logits)  # one launch: the step's logits afresh
        cc.mask(seqs, work)

    stopped = seqs[:STOPPED]
    argmax = torch.zeros(STOPPED, Cn, dtype=torch.long, device=dev)

    def final():
        kept = [(cc.rows[s.row].state, cc.rows[s.row].steps) for s in stopped]
        out = cc.final(stopped, argmax)
        for s, (state, steps) in zip(stopped, kept):
            cc.rows[s.row].state, cc.rows[s.row].steps = state, steps
        return out

    mask()  # a masked step first: `final` reads its paths
    assert all(s.error is None for s in seqs), "the step errored a row"
    assert [len(t) for t in final()] == [Cn] * STOPPED, "final's tokens"
    check = cc._check(cc.rows[0], SCHEMA)
    doc = '{"answer": 42, "totals": [3, 10, 42]}'
    assert check(doc) is None and check('{"answer": 1}') is not None, "the output check"

    with PhaseClock() as clock:
        mask_us = host_us(mask, n)
    parts = {k: round(1e6 * v / (n + 3), 1) for k, v in sorted(clock.seconds.items(), key=lambda kv: -kv[1])}
    res = {
        f"mask, {ROWS} of {SLOTS} rows": mask_us,
        f"final, {STOPPED} stopped": host_us(final, n),
        "begin, one canvas": host_us(lambda: cc.begin(seqs[0], seqs[0].canvases[0]), n),
        "output check, one document": host_us(lambda: check(doc), n),
    }
    res[f"mask to its device work done, {ROWS} of {SLOTS} rows"] = host_us(mask, n, done=True)
    kernels = device_us(mask, min(n, 50))
    med = {k: round(statistics.median(v), 1) for k, v in res.items()}
    for name, us in med.items():
        print(f"{name:40s} {us:9.1f} µs a call (host, median of {n})", flush=True)
    print(
        "mask's parts (µs a call, with the phase clock's ~1 µs a part): "
        + ", ".join(f"{k} {v}" for k, v in parts.items())
    )
    if kernels:
        print("mask's kernels (device µs a call): " + ", ".join(f"{k} {v}" for k, v in kernels.items()))
    report = {"bench": "constraint_step", "calls": n, "host_us_median": med, "mask_parts_us": parts}
    if a.host_profile or a.quick:
        report |= host_profile(mask, n)
    report["mask_device_us"] = kernels
    print(json.dumps(report), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "constraint_step.json"), "w") as f:
            json.dump({**report, **C.device_info()}, f, indent=1)


if __name__ == "__main__":
    main()
