"""Accuracy of the official sampler on our runtime against HF `generate()`, on one device, one process.

    python3 benchmarks/gpu_accuracy.py --device cuda --n 200 --seeds 61 --arm hf --arm official \
        --arm 'official:fp8=off' --arm 'official:cuda_graphs=off@kernels=false' --out $OUT

The standing GPU guard (`--guard`: hf against the default `official` path, both at the same prompts
and seeds) and the ablation that explains a difference (one factor per arm). An arm is
`decoder[:knob=value,...][@setting=value,...]`: knobs are the decoder's config fields (`canvasq bench`
syntax); settings after '@' are what a config does not reach:

    dtype=fp32|bf16          the model's dtype (a second bundle of the same checkpoint)
    batch=N                  requests per run_batch call (default --batch-size)
    experts_impl=reference   bf16 experts as the per-expert loop instead of grouped GEMMs
    kernels=false            the runtime's torch twins instead of its Triton norms / router / softcap
    context_step=N           decoder steps' context bucket (0: exact length)
    sdpa_backend=B, encoder_sdpa_backend=B   attention kernels of masked eager forwards
    prefix_attention=false   no mask-free SDPA for all-visible windows
    stats=torch              the torch sampler's statistics in torch ops instead of the fused kernel
    defer_head_bytes=N       LM head deferred past N bytes of fp32 logits, read by row group (1: one
                             window a group, every forward; 0: never)
    kernel_rows=N            windows of up to N rows through our attention kernel (0: all SDPA)
    attention_tiles=S        the kernel's tiles by head dim ("256:64x32x4x2/512:64x32x8x2")
    sc_bag=torch|triton      self-conditioning's top-k bag (`Runtime.sc_bag`)
    graph_rows=N             the graph runner's logits buffer in padded rows (default
                             `graph.LOGITS_BYTES`; the testbed's forwards never pass it unless made small)
    deferred_rows=N          graphs whose LM head is deferred for forwards past that buffer, up to N
                             padded rows (`GraphRunner.deferred_rows`)
    fp8_grouped=G            the FP8 experts' grouped GEMM (CANVASQ_FP8_GROUPED: torch, triton, or
                             w4a8: the W4 pack's nibbles against e4m3 rows, wgmma on sm_90)

Each arm gets runtimes of its own (built when its decoder asks, with the settings applied), so
arms never share captured graphs. Accuracy, forwards per request and τ are exact per (prompts, seed);
the arm order does not change them. One table row per arm is printed as it finishes and the whole
report is written to --out (gpu_accuracy.json, gpu_accuracy.md), so a call cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {
    "dtype": str,
    "batch": int,
    "kernels": "bool",
    "experts_impl": str,
    "context_step": int,
    "sdpa_backend": str,
    "encoder_sdpa_backend": str,
    "prefix_attention": "bool",
    "stats": str,
    "defer_head_bytes": int,
    "kernel_rows": int,
    "attention_tiles": str,
    "sc_bag": str,
    "graph_rows": int,
    "deferred_rows": int,
    "fp8_grouped": str,
}
RUNTIME_ATTRS = (
    "context_step",
    "sdpa_backend",
    "encoder_sdpa_backend",
    "prefix_attention",
    "defer_head_bytes",
    "kernel_rows",
    "attention_tiles",
    "sc_bag",
)
# the guard: HF's generate(), official with its defaults on the bf16 model `canvasq bench` loads, and
# official as a GPU worker runs it by default (W4 experts, 64 decode slots on an H200)
GUARD_ARMS = ("hf", "official", "official:experts=w4@batch=64")


def parse_settings(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        kind = SETTINGS.get(name.strip())
        if kind is None:
            raise SystemExit(f"unknown setting {name!r} after '@'; known: {', '.join(SETTINGS)}")
        out[name.strip()] = (
            value.strip().lower() in ("1", "true", "on") if kind == "bool" else kind(value.strip())
        )
    return out


@contextlib.contextmanager
def arm_runtime(settings: dict):
    """Runtimes built for this arm alone, with its settings; the stats patch for its duration."""
    from canvasq import kernels
    from canvasq.decoders import runtimes
    from canvasq.model.fp8 import install_fp8, parse_parts
    from canvasq.model.runtime import Runtime

    built: dict = {}

    def runtime_for(hf_model, experts, fp8="off", fp8_min_rows=0, encoder_model=None):
        parts = parse_parts(fp8, next(hf_model.parameters()).device)
        key = (id(hf_model), experts, parts, fp8_min_rows if parts else 0, id(encoder_model))
        if key not in built:
            impl = settings.get("experts_impl", experts) if experts == "bf16" else experts
            rt = Runtime.from_hf(
                hf_model, experts=impl, encoder_model=encoder_model, kernels=settings.get("kernels")
            )
            if parts:
                install_fp8(rt, parts, fp8_min_rows, settings.get("fp8_grouped"))
            for name in RUNTIME_ATTRS:
                if name in settings:
                    setattr(rt, name, settings[name])
            _graph_settings(rt, settings)
            built[key] = rt
        return built[key]

    saved = runtimes.runtime_for, kernels.softmax_argmax
    runtimes.runtime_for = runtime_for
    if settings.get("stats") == "torch":
        kernels.softmax_argmax = lambda logits, temperature=1.0, impl="auto": (
            kernels.softmax_argmax_reference(logits, temperature)
        )
    try:
        yield
    finally:
        runtimes.runtime_for, kernels.softmax_argmax = saved


def _graph_settings(rt, settings: dict) -> None:
    """`graph_rows` and `deferred_rows` on the runtime's graph runner (made here, as the decoder would)."""
    if "graph_rows" not in settings and "deferred_rows" not in settings:
        return
    from canvasq.model.graph import graph_runner

    rows = settings.get("graph_rows")
    graph_runner(rt).set_limits(rows and rows * 4 * rt.vocab_size, settings.get("deferred_rows"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arm", action="append", default=[])
    ap.add_argument(
        "--guard", action="store_true", help=f"the arms {', '.join(GUARD_ARMS)} (before any --arm)"
    )
    ap.add_argument("--task", action="append", default=[])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seeds", default="61")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--experts", default="bf16", help="the bundle's experts (w4: packed at load, as a GPU worker)"
    )
    ap.add_argument("--out", default="gpu-accuracy-out")
    args = ap.parse_args()

    from canvasq.decoders import bench as B
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks

    arms = [*(GUARD_ARMS if args.guard else ()), *args.arm] or list(GUARD_ARMS)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    task_names = args.task or ["arith", "code"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bundles: dict = {}
    rows, t_all = [], time.perf_counter()
    report = {
        "device": args.device,
        **B._provenance(args.device),
        "tasks": task_names,
        "n": args.n,
        "seeds": seeds,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "arms": rows,
    }
    print("| arm | n | acc | arith | code | fwd/req | tok/fwd | s |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in arms:
        knobs, _, rest = spec.partition("@")
        settings = parse_settings(rest)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[settings.get("dtype", "bf16")]
        if dtype not in bundles:
            experts = "bf16" if dtype == torch.float32 else args.experts
            bundles[dtype] = load_bundle(device=args.device, dtype=dtype, experts=experts)
        arm = B.parse_arm(knobs)
        t0 = time.perf_counter()
        with arm_runtime(settings):
            rep = B.run_bench(
                bundles[dtype],
                [arm],
                task_names,
                n=args.n,
                seeds=seeds,
                batch_size=settings.get("batch", args.batch_size),
                max_tokens=args.max_tokens,
                suite=tasks,
            )
        row = {**rep["arms"][0], "arm": spec, "settings": settings, "wall_s": time.perf_counter() - t0}
        rows.append(row)
        per = row["per_task"]
        print(
            f"| {spec} | {row['n']} | {row['acc']:.3f} | {per.get('arith', {}).get('acc', float('nan')):.3f} | "
            f"{per.get('code', {}).get('acc', float('nan')):.3f} | {row['fwd_per_req']:.2f} | "
            f"{row['tok_per_fwd']:.2f} | {row['wall_s']:.0f} |",
            flush=True,
        )
        (out / "gpu_accuracy.json").write_text(json.dumps(report, indent=1))
    md = [
        f"# Official on our runtime against HF generate() — {args.device}",
        "",
        (
            f"{report.get('date', '')}; {report.get('hardware', '')}; commit {report.get('commit', '')}; "
            f"tasks {', '.join(task_names)}; n = {args.n} per task per seed; seeds {seeds}; "
            f"batch {args.batch_size}; max_tokens {args.max_tokens}; real schedules (not replayed)."
        ),
        "",
        "| arm | n | acc | arith | code | fwd/req | tok/fwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = r["per_task"]
        md.append(
            f"| {r['arm']} | {r['n']} | {r['acc']:.3f} | {per.get('arith', {}).get('acc', float('nan')):.3f} | "
            f"{per.get('code', {}).get('acc', float('nan')):.3f} | {r['fwd_per_req']:.2f} | {r['tok_per_fwd']:.2f} |"
        )
    (out / "gpu_accuracy.md").write_text("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
