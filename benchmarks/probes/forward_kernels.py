"""Where a large decoder forward's GPU time goes, kernel by kernel (issue 34, item 5).

    python3 benchmarks/probes/forward_kernels.py                 # GPU: random:26b-a4b, W4 + FP8 auto
    python3 benchmarks/probes/forward_kernels.py --quick         # CPU smoke: the testbed's shape

The model is the worker's (`load_bundle(..., experts="w4")`, `runtime_for(..., fp8="auto")`), so the
forward is the one the loop runs at each batch: B windows of 256 rows with top-64 self-conditioning.
Per batch: the eager and graph-replayed ms (median of `--iters`), an eager forward's host ms (call to
return, the device idle at the call), then torch.profiler over `--reps` eager forwards: its CUDA
kernels summed by name and by group (experts' GEMMs, their permutation and quantisation, dense GEMMs,
attention, LM head, norms, other), in ms per forward, and its host side (`host`: the calls that wait
for the device, the ops with the most host time of their own). With `--moe` the
FP8 expert layer alone at B x 256 rows gets the same split. Raw tables land in $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from canvasq.provenance import git_commit

# kernel name, lowercased -> group (first match wins); names are torch's, CUTLASS's and ours
GROUPS = [
    ("experts_gemm", r"grouped|groupproblemshape|w4_moe|w4a8|moe_.*gemm|_w4_"),
    ("lm_head_or_dense_gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|_scaled_mm|sm90"),
    ("attention", r"attn|attention|_attend|flash|fmha|sdpa"),
    ("quantise", r"quant|fp8"),
    ("sort_scatter_gather", r"sort|radix|scatter|gather|index|searchsorted|cub"),
    ("norm_rope", r"norm|rope"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|cat|reduce"),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, pat in GROUPS:
        if re.search(pat, low):
            return group
    return "other"


def kernel_table(prof, reps: int, cuda: bool) -> tuple[list[dict], dict[str, float]]:
    """CUDA kernels (on the CPU: ops) by name (ms per forward, calls per forward) and their groups'
    sums."""
    rows = []
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for evt in prof.key_averages():
        if evt.device_type != want:
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        rows.append({"kernel": evt.key[:160], "ms": us / 1e3 / reps, "calls": evt.count / reps})
    rows.sort(key=lambda r: -r["ms"])
    groups: dict[str, float] = {}
    for r in rows:
        r["group"] = group_of(r["kernel"])
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["ms"]
    return rows, groups


# host calls that wait for the device: a forward that makes them stops launching until the GPU catches up
SYNCS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|aten::_local_scalar_dense"
    r"|aten::item|aten::nonzero)$"
)


def host_table(prof, reps: int, top: int = 12) -> dict:
    """The profiled forwards' host side: the calls that wait for the device (count and ms a forward)
    and the ops with the most host time of their own (ms a forward)."""
    cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    waits = {e.key: [e.count / reps, e.self_cpu_time_total / 1e3 / reps] for e in cpu if SYNCS.match(e.key)}
    mine = sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "waits": waits,
        "top_self": [
            [e.key[:80], round(e.self_cpu_time_total / 1e3 / reps, 3), e.count / reps] for e in mine
        ],
    }


def host_ms(fn, iters: int) -> float:
    """Median ms from a forward's call to its return, the device idle at the call: its host time when
    nothing in it waits for the device (else at least the device time up to its last wait)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def profiled(fn, reps: int, cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return prof


def timed(fn, iters: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def forward_case(rt, runner, batch: int, prompt: int, args, cuda: bool) -> dict:
    from canvasq.model.runtime import Window

    device = rt.device
    C, V = 256 if not args.quick else 32, rt.vocab_size
    arena = rt.new_arena(batch, prompt + 2 * C)
    for b in range(batch):
        rt.encode(
            arena, b, torch.randint(0, V, (prompt,), device=device), torch.arange(prompt, device=device)
        )
    k = min(64, V)
    sc = (torch.randint(0, V, (C, k), device=device), torch.randn(C, k, device=device).to(rt.dtype))
    wins = [
        Window.canvas(b, torch.randint(0, V, (C,), device=device), prompt, self_cond=sc) for b in range(batch)
    ]
    res = {"batch": batch, "rows": batch * C, "fp8": rt.fp8_parts if batch * C >= rt.fp8_min_rows else ()}
    # "kernel": our attention kernel with visibility from the arena, as the worker loop's decoder steps
    # run; "sdpa": the mask-free SDPA call an all-visible eager forward takes (the bare benchmarks')
    prefix = args.attention == "sdpa"
    res["attention"] = args.attention
    res["eager_ms"] = timed(lambda: rt.decode(arena, wins, prefix_attention=prefix), args.iters, cuda)
    if runner is not None:
        garena = runner.arena(batch, prompt + 2 * C)
        if garena is not None:
            for b in range(batch):
                runner.encode_many(
                    garena,
                    [(b, torch.randint(0, V, (prompt,), device=device), torch.arange(prompt, device=device))],
                )
            # a graph past the logits buffer defers its head: its logits made here, as eager makes them
            res["graph_ms"] = timed(
                lambda: runner.decode(garena, wins, prefix_attention=prefix).logits, args.iters, cuda
            )
            res["graph_deferred"] = runner.takes(batch, C) and batch * C > runner.max_rows
            del garena
    if cuda:
        res["host_ms"] = host_ms(lambda: rt.decode(arena, wins, prefix_attention=prefix), args.iters)
    prof = profiled(lambda: rt.decode(arena, wins, prefix_attention=prefix), args.reps, cuda)
    res["host"] = host_table(prof, args.reps)
    rows, groups = kernel_table(prof, args.reps, cuda)
    res["gpu_ms"] = sum(r["ms"] for r in rows)
    res["groups_ms"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    res["kernels"] = rows[: args.top]
    res["launches"] = sum(r["calls"] for r in rows)
    return res


def moe_case(rt, rows_n: int, args, cuda: bool) -> dict:
    from canvasq.model.fp8 import fp8_moe

    lw = next(lw for lw in rt.dec_layers if getattr(lw, "fp8", None) and "experts" in lw.fp8)
    ex = lw.fp8["experts"]
    E, H = ex.gate_up.shape[0], ex.gate_up.shape[2]
    x = torch.randn(rows_n, H, device=rt.device, dtype=rt.dtype)
    ids = torch.stack([torch.randperm(E, device=rt.device)[: rt.top_k] for _ in range(rows_n)])
    w = torch.rand(rows_n, rt.top_k, device=rt.device)

    def call():
        return fp8_moe(x, ids, w, ex, defer_combine=True, kernel=cuda)

    res = {"rows": rows_n, "ms": timed(call, args.iters, cuda)}
    prof = profiled(call, args.reps, cuda)
    krows, groups = kernel_table(prof, args.reps, cuda)
    res["gpu_ms"] = sum(r["ms"] for r in krows)
    res["groups_ms"] = groups
    res["kernels"] = krows[: args.top]
    return res


def set_grouped(rt, impl: str) -> str:
    """Every FP8 expert layer of `rt` takes `impl`'s grouped GEMM (`model.fp8.parse_grouped`); "w4a8"
    swaps in the W4 pack's experts (`fp8.W4A8Experts`), made once a pack and kept beside the e4m3 copy."""
    from canvasq.model.fp8 import W4A8Experts, parse_grouped

    impl = parse_grouped(impl)
    arms = rt.__dict__.setdefault("_expert_arms", {})  # id(layer) -> its e4m3 experts; id(pack) -> W4A8
    for lw in rt.enc_layers + rt.dec_layers:
        fp8 = getattr(lw, "fp8", None) or {}
        if "experts" not in fp8:
            continue
        e4m3 = arms.setdefault(id(lw), fp8["experts"])
        if impl == "w4a8":
            key = id(lw.experts_packed)
            if key not in arms:
                arms[key] = W4A8Experts.from_w4(lw.experts_packed)
            fp8["experts"] = arms[key]
        else:
            fp8["experts"], e4m3.grouped = e4m3, impl
    return impl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, the testbed's shape")
    ap.add_argument("--batches", default="4,16", help="windows of 256 rows per forward")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="forwards under the profiler")
    ap.add_argument("--top", type=int, default=40, help="kernels listed per case")
    ap.add_argument("--moe", action="store_true", help="also the FP8 expert layer alone")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--attention",
        choices=("kernel", "sdpa"),
        default="kernel",
        help="kernel: our attention kernel, as the worker loop's decoder steps (default); sdpa: the "
        "mask-free SDPA path of an all-visible eager forward, as the bare benchmarks",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder (and encoder) layers of the real shape (default 30; an H100 cannot build all 30 in bf16)",
    )
    ap.add_argument(
        "--sc-bags",
        default=None,
        help="comma list of self-conditioning bags to time, arms in this process (`Runtime.sc_bag`: "
        "torch, triton; default: the runtime's)",
    )
    ap.add_argument(
        "--fp8-arms",
        default="auto",
        help="semicolon list of CANVASQ_FP8 values, one runtime each, arms in this process (e.g. "
        "'auto;dense,head': the experts kept W4 at every size)",
    )
    ap.add_argument(
        "--deferred-rows",
        type=int,
        default=None,
        help="the graph runner's `deferred_rows`: graphs, their LM head deferred, for forwards past the "
        "logits buffer up to these padded rows (default: the runner's, `graph.DEFERRED_ROWS`)",
    )
    ap.add_argument(
        "--grouped",
        default=None,
        help="comma list of the FP8 experts' grouped GEMMs to time, arms in this process "
        "(CANVASQ_FP8_GROUPED: torch, triton; default: the runtime's)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    from canvasq.core.settings import Settings
    from canvasq.decoders.runtimes import runtime_for
    from canvasq.model.graph import graph_runner
    from canvasq.model.loading import load_bundle

    spec = "random:testbed" if args.quick else "random:26b-a4b"
    if args.layers and not args.quick:  # the real width, fewer layers: per-layer figures are the same
        from canvasq.model import shapes

        name = f"26b-a4b-{args.layers}l"
        shapes.SHAPES[name] = shapes.SHAPES["26b-a4b"].replace(num_hidden_layers=args.layers)
        spec = f"random:{name}"
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    bundle = load_bundle(spec, device=device, experts="w4" if cuda else "bf16")
    fp8_arms = args.fp8_arms.split(";") if cuda else ["off"]
    rts = {
        arm: runtime_for(bundle.hf_model, "w4" if cuda else "bf16", arm, Settings().fp8_min_rows)
        for arm in fp8_arms
    }
    for arm, rt in rts.items():
        print(
            f"loaded {spec} in {time.perf_counter() - t0:.1f}s; CANVASQ_FP8={arm}: {rt.fp8_parts} from "
            f"{rt.fp8_min_rows} rows",
            flush=True,
        )
    report = {
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "spec": spec,
        "layers": len(rt.dec_layers),
    }
    report["forward"] = []
    batches = [int(b) for b in args.batches.split(",")] if not args.quick else [2]
    rt = rts[fp8_arms[0]]
    bags = args.sc_bags.split(",") if args.sc_bags else [rt.sc_bag]
    impls = args.grouped.split(",") if args.grouped else [None]
    cases = [(arm, bag, g, b) for arm in fp8_arms for bag in bags for g in impls for b in batches]
    for arm, bag, impl, b in cases:
        rt = rts[arm]
        rt.sc_bag = bag  # part of a graph's key: each bag captures its own
        if impl is not None:  # not in a graph's key: each arm captures with a runner of its own
            impl = set_grouped(rt, impl)
            rt.graph_runner = None
        runner = graph_runner(rt) if cuda and not args.no_graphs else None
        if runner is not None:
            runner.set_limits(deferred_rows=args.deferred_rows)
        r = forward_case(rt, runner, b, args.prompt if not args.quick else 16, args, cuda)
        r = {"fp8": arm, "fp8_parts": r.pop("fp8", None), "sc_bag": bag, "grouped": impl, **r}
        report["forward"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
        for row in r["kernels"][:25]:
            print(f"  {row['ms']:8.3f} ms {row['calls']:6.0f}x {row['group']:22s} {row['kernel'][:100]}")
        if cuda:
            torch.cuda.empty_cache()
    if args.moe and cuda:
        report["moe"] = []
        for b in batches:
            r = moe_case(rts[fp8_arms[0]], b * 256, args, cuda)
            report["moe"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
            for row in r["kernels"][:15]:
                print(f"  {row['ms']:8.3f} ms {row['calls']:6.0f}x {row['group']:22s} {row['kernel'][:100]}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "forward_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
