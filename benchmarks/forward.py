"""Decoder forward: canvasq.model.runtime vs HF DiffusionGemma, same process, same weights.

    python3 benchmarks/forward.py            # H200: real 26B-A4B shape, random weights, bf16
    python3 benchmarks/forward.py --quick    # CPU: testbed shape, fp32, a few configs (CI smoke)

Per (rows M per sequence, batch B): ms per decoder forward (CUDA events after warm-up, median over
rotated inputs) for HF's model (its default experts implementation: grouped_mm on CUDA) and for our
runtime with each experts arm (bf16 grouped GEMMs, W4A16 Triton) and, with --graphs, the same step
replayed as a CUDA graph. Every arm's logits are compared with HF's in the same run (rel. error =
max |ours - HF| / max |HF|; bf16 bound 2e-2; W4 changes the weights, so its error is reported, not
bounded). Bytes: weights a forward must read (dense + attention + LM head + touched experts: expected
distinct experts under uniform routing) over the measured time = GB/s and fraction of the floor at
the measured read bandwidth (~4.5 TB/s on the H200). A profile split (attention, dense MLP, experts incl.
router, LM head, self-conditioning, other) comes from CUDA events around our runtime's scopes.

Prints a Markdown table; the last line is one JSON object. With $OUT set, raw results go to
$OUT/forward.json (and a torch profiler table to $OUT/forward_profile.txt with --torch-profile).
Random weights never converge: only seconds per forward mean anything here (commit schedules are
replayed elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canvasq.model.graph import DecodeGraph
from canvasq.model.loading import cache_kwargs
from canvasq.model.runtime import Runtime, Window
from canvasq.provenance import git_commit

READ_BW = 4.5e12  # bytes/s, the H200's measured read bandwidth
BF16_TOL = 2e-2


# --- model -----------------------------------------------------------------------------------------
def build_model(quick: bool, device: str, dtype: torch.dtype, no_ref: bool = False):
    """HF's model at the shape with random weights, and the seconds it took. `no_ref`: the worker's
    random W4 bundle instead (`load_bundle`, experts packed layer by layer as they are made, their
    BF16 freed), which an 80 GiB card holds; HF's BF16 build (2 x 45 GiB of experts before it ties
    them) does not."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvasq.model.shapes import REAL_26B_A4B, TESTBED, build_config

    torch.manual_seed(0)
    t0 = time.perf_counter()
    if no_ref:
        from canvasq.model.loading import load_bundle

        model = load_bundle(
            f"random:{'testbed' if quick else '26b-a4b'}", device, dtype, experts="w4"
        ).hf_model
    else:
        config = build_config(TESTBED if quick else REAL_26B_A4B)
        with torch.device(device):
            model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype).eval()
    _randomize_small_params(model)
    sync(device)
    return model, time.perf_counter() - t0


@torch.no_grad()
def _randomize_small_params(model) -> None:
    """HF initialises norm weights, router scales and per-expert scales to constants; draw them around
    1 so every weight matters (a constant-1 scale would hide a skipped multiply)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "vision" not in name:
            p.copy_((0.75 + 0.5 * torch.rand(p.shape, generator=g)).to(p.device, p.dtype))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- timing ----------------------------------------------------------------------------------------
def time_fn(fn, inputs: list, warmup: int, iters: int, device: str) -> float:
    """Median ms of fn(input) over `iters` calls, inputs rotated, after `warmup` calls."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    sync(device)
    times = []
    for i in range(iters):
        x = inputs[i % len(inputs)]
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class ScopeTimer:
    """Installed as `Runtime.scope`: CUDA events (or wall clock on CPU) around each named region."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.spans: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def scope(self, name: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self.spans.append((name, a, b))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, a, b in self.spans:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out


def build_arm(model, arm: str) -> Runtime:
    """`bf16`, `w4`, ... or `<experts>+fp8` (every FP8 part) / `<experts>+fp8=experts,head` (those
    parts): the FP8 copies on for every forward (threshold 0)."""
    from canvasq.model.fp8 import PARTS, install_fp8

    experts, _, extra = arm.partition("+")
    rt = Runtime.from_hf(model, experts=experts)
    if extra:
        name, _, parts = extra.partition("=")
        if name != "fp8":
            raise ValueError(f"unknown arm suffix {extra!r}")
        install_fp8(rt, tuple(parts.split(",")) if parts else PARTS, min_rows=0)
    return rt


def flop_per_row(rt: Runtime, context: int) -> float:
    """FLOPs one decoder row costs: 2 x the weights it multiplies (q/k/v/o, dense MLP, router, its K
    experts, LM head) plus attention scores and values over `context` keys (sliding layers capped)."""
    total = 2 * rt.lm_head.numel()
    for lw in rt.dec_layers:
        for t in (lw.wq, lw.wk, lw.wv, lw.wo, lw.mlp_gate, lw.mlp_up, lw.mlp_down, lw.router_proj):
            if t is not None:
                total += 2 * t.numel()
        if lw.gate_up is not None:
            total += 2 * rt.top_k * (lw.gate_up[0].numel() + lw.down[0].numel())
        else:
            p = lw.experts_packed
            total += 2 * rt.top_k * 3 * p.hidden * p.inter
        keys = min(context, rt.sliding_window) if lw.sliding else context
        total += 4 * lw.heads * lw.head_dim * keys
    return float(total)


BF16_PEAK = 759e12  # measured on the H200: an 8192^3 bf16 GEMM
FP8_PEAK = 2 * BF16_PEAK  # Hopper's FP8 tensor cores: twice the bf16 rate


# --- bytes -----------------------------------------------------------------------------------------
def forward_bytes(rt: Runtime, rows: int, experts: str) -> float:
    """Weight bytes one decoder forward reads (activations and KV are small next to them)."""
    el = rt.embed.element_size()
    dense = 0
    for lw in rt.dec_layers:
        for t in (lw.wq, lw.wk, lw.wv, lw.wo, lw.mlp_gate, lw.mlp_up, lw.mlp_down, lw.router_proj):
            if t is not None:
                dense += t.numel() * el
    head = rt.lm_head.numel() * el
    lw = rt.dec_layers[0]
    packed = lw.experts_packed
    if lw.gate_up is not None:
        n_exp, per_expert = lw.gate_up.shape[0], (lw.gate_up[0].numel() + lw.down[0].numel()) * el
    else:  # packed at load, the BF16 freed (--no-ref)
        n_exp, per_expert = packed.num_experts, 3 * packed.hidden * packed.inter * el
    if experts.startswith("w4") and packed is not None:
        per_expert = packed.nbytes() / n_exp
    touched = n_exp * (1 - (1 - rt.top_k / n_exp) ** rows)  # expected distinct experts, uniform routing
    return dense + head + rt.num_layers * touched * per_expert


# --- one configuration -----------------------------------------------------------------------------
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def hf_cache(model, prompts: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config())
    b, p = prompts.shape
    with torch.no_grad():
        model.model.encoder(
            input_ids=prompts,
            position_ids=torch.arange(p, device=prompts.device)[None].expand(b, p),
            **cache_kwargs(model.model.encoder, cache),
        )
    return cache


def run_config(model, runtimes: dict, rows: int, batch: int, prompt_len: int, args, device: str) -> dict:
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator(device="cpu").manual_seed(rows * 100 + batch)
    prompts = torch.randint(5, vocab, (batch, prompt_len), generator=g).to(device)
    canvases = [torch.randint(5, vocab, (batch, rows), generator=g).to(device) for _ in range(args.rotate)]
    sc_logits = None
    if args.sc != "none":
        sc_logits = (torch.randn(batch, rows, vocab, generator=g) * 4).to(device, model.dtype)
    pos = torch.arange(prompt_len, prompt_len + rows, device=device)[None].expand(batch, rows)
    res = {"rows": rows, "batch": batch, "prompt": prompt_len, "sc": args.sc}
    if args.no_ref:  # no HF forward to compare with or time: our arms only
        return _arms_only(runtimes, res, prompts, canvases, sc_logits, rows, args, device)
    cache = hf_cache(model, prompts)

    def hf_step(canvas):
        with torch.no_grad():
            return model(
                decoder_input_ids=canvas,
                **cache_kwargs(model, cache),
                decoder_position_ids=pos,
                self_conditioning_logits=sc_logits,
            ).logits

    if batch > args.ref_max_batch:  # HF's [B*M, V] logits and ours side by side outgrow the GPU
        return _arms_only(runtimes, res, prompts, canvases, sc_logits, rows, args, device)
    ref = hf_step(canvases[0]).reshape(batch * rows, vocab)
    # Noise yardstick: HF against itself with its other experts implementation (same weights, same
    # inputs, only the kernels' rounding differs). Random weights amplify bf16 rounding through the
    # layers, so "ours vs HF" is read against this figure.
    if hasattr(model, "set_experts_implementation") and device.startswith("cuda"):
        try:
            model.set_experts_implementation("eager")
            alt = hf_step(canvases[0]).reshape(batch * rows, vocab)
            res["hf_eager_vs_grouped_err"] = rel_err(alt, ref)
            res["hf_eager_vs_grouped_argmax_agree"] = float((alt.argmax(-1) == ref.argmax(-1)).float().mean())
            del alt
        except Exception as e:  # noqa: BLE001 -- a yardstick, not a result
            res["hf_yardstick_error"] = f"{type(e).__name__}: {e}"
        finally:
            model.set_experts_implementation("grouped_mm")
    if not args.no_hf:
        res["hf_ms"] = time_fn(hf_step, canvases, args.warmup, args.iters, device)

    for name, rt in runtimes.items():
        try:
            res.update(run_arm(name, rt, ref, prompts, canvases, sc_logits, rows, args, device))
        except Exception as e:  # noqa: BLE001 -- one broken arm must not hide the others' numbers
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"[forward] {name} B={batch} M={rows}: {res[f'{name}_error']}", file=sys.stderr)
    return res


def _arms_only(runtimes: dict, res: dict, prompts, canvases, sc_logits, rows: int, args, device: str) -> dict:
    """Each arm timed with no reference logits (an arm that fails reports its error)."""
    args_no_hf = argparse.Namespace(**{**vars(args), "no_hf": True})
    for name, rt in runtimes.items():
        try:
            res.update(run_arm(name, rt, None, prompts, canvases, sc_logits, rows, args_no_hf, device))
        except Exception as e:  # noqa: BLE001 -- one broken arm must not hide the others' numbers
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    return res


def run_arm(name: str, rt: Runtime, ref, prompts, canvases, sc_logits, rows: int, args, device: str) -> dict:
    """Our runtime with one experts arm on the inputs HF saw: error vs HF, eager ms, graph ms."""
    batch, prompt_len = prompts.shape
    res = {}
    arena = rt.new_arena(batch, prompt_len + rows + 8)
    rt.encode_many(arena, [(b, prompts[b], torch.arange(prompt_len, device=device)) for b in range(batch)])
    sc_inputs = []
    for b in range(batch):
        if args.sc == "none":
            sc_inputs.append(None)
        elif args.sc == "full":
            sc_inputs.append(sc_logits[b])
        else:
            top = sc_logits[b].float().topk(args.topk, dim=-1)
            sc_inputs.append((top.indices, top.values))

    def windows(canvas):
        return [Window.canvas(b, canvas[b], prompt_len, self_cond=sc_inputs[b]) for b in range(batch)]

    prefix = args.attention == "sdpa"  # the kernel (masked) path is the worker loop's; see --attention

    def ours_step(canvas):
        return rt.decode(arena, windows(canvas), prefix_attention=prefix).logits

    out = ours_step(canvases[0])
    if ref is not None:
        res[f"{name}_err"] = rel_err(out, ref) if args.sc != "topk" else None
        res[f"{name}_argmax_agree"] = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    del out
    res[f"{name}_ms"] = time_fn(ours_step, canvases, args.warmup, args.iters, device)
    fl = flop_per_row(rt, prompt_len + rows) * rows * batch
    res["gflop_per_row"] = fl / (rows * batch) / 1e9
    res[f"{name}_tflops"] = fl / (res[f"{name}_ms"] * 1e-3) / 1e12
    nbytes = forward_bytes(rt, rows * batch, name)
    res[f"{name}_GBps"] = nbytes / (res[f"{name}_ms"] * 1e-3) / 1e9
    res[f"{name}_floor_frac"] = nbytes / READ_BW / (res[f"{name}_ms"] * 1e-3)

    if args.graphs and device.startswith("cuda"):
        try:
            graph = DecodeGraph(rt, arena, windows(canvases[0]))

            def graph_step(canvas):
                return graph.run(windows(canvas)).logits

            gout = graph_step(canvases[0])
            res[f"{name}_graph_err"] = rel_err(gout, ref) if args.sc != "topk" and ref is not None else None
            del gout
            res[f"{name}_graph_ms"] = time_fn(graph_step, canvases, args.warmup, args.iters, device)
            res[f"{name}_graph_tflops"] = fl / (res[f"{name}_graph_ms"] * 1e-3) / 1e12
            res[f"{name}_graph_pct_bf16_peak"] = 100 * res[f"{name}_graph_tflops"] * 1e12 / BF16_PEAK
            res[f"{name}_graph_pct_fp8_peak"] = 100 * res[f"{name}_graph_tflops"] * 1e12 / FP8_PEAK
        except Exception as e:  # noqa: BLE001 -- report, keep the eager numbers
            res[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"
            print(f"[forward] graph {name}: {res[f'{name}_graph_error']}", file=sys.stderr)
    return res


def profile_split(rt: Runtime, model, rows: int, prompt_len: int, args, device: str) -> dict:
    vocab = rt.vocab_size
    g = torch.Generator(device="cpu").manual_seed(7)
    arena = rt.new_arena(1, prompt_len + rows + 8)
    rt.encode(
        arena,
        0,
        torch.randint(5, vocab, (prompt_len,), generator=g).to(device),
        torch.arange(prompt_len, device=device),
    )
    canvas = torch.randint(5, vocab, (rows,), generator=g).to(device)
    sc = (torch.randn(rows, vocab, generator=g) * 4).to(device)
    top = sc.topk(args.topk, dim=-1)
    out = {}
    for label, self_cond in (
        ("no_sc", None),
        ("full_sc", sc),
        (f"top{args.topk}_sc", (top.indices, top.values)),
    ):
        win = [Window.canvas(0, canvas, prompt_len, self_cond=self_cond)]
        for _ in range(args.warmup):
            rt.decode(arena, win)
        sync(device)
        timer = ScopeTimer(device)
        rt.scope = timer.scope
        reps = max(3, args.iters // 4)
        t = []
        try:
            for _ in range(reps):
                if device.startswith("cuda"):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    rt.decode(arena, win)
                    b.record()
                    b.synchronize()
                    t.append(a.elapsed_time(b))
                else:
                    s = time.perf_counter()
                    rt.decode(arena, win)
                    t.append((time.perf_counter() - s) * 1e3)
        finally:
            rt.scope = lambda name: contextlib.nullcontext()
        tot = timer.totals()
        total = sum(t) / reps
        split = {k: v / reps for k, v in tot.items()}
        split["other"] = total - sum(split.values())
        split["total"] = total
        out[label] = {k: round(v, 3) for k, v in split.items()}
    if args.torch_profile and os.environ.get("OUT"):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            rt.decode(arena, [Window.canvas(0, canvas, prompt_len)])
            sync(device)
        key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
        Path(os.environ["OUT"], "forward_profile.txt").write_text(
            prof.key_averages().table(sort_by=key, row_limit=60)
        )
        out["kernel_launches"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return out


def encode_timing(model, runtimes: dict, prompt_len: int, args, device: str) -> dict:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(5, vocab, (1, prompt_len)).to(device)
    res = {"prompt": prompt_len}
    if not args.no_hf:
        res["hf_ms"] = time_fn(lambda x: hf_cache(model, x), [ids], args.warmup, args.iters, device)
    for name, rt in runtimes.items():
        res[f"{name}_ms"] = time_fn(
            _encoder_step(rt, prompt_len, device), [ids], args.warmup, args.iters, device
        )
    return res


def _encoder_step(rt: Runtime, prompt_len: int, device: str):
    arena = rt.new_arena(1, prompt_len)

    def enc(x):
        arena.reset(0)
        rt.encode(arena, 0, x[0], torch.arange(prompt_len, device=device))

    return enc


# --- main ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    """-> (args, rows, batches, arms, device, dtype): the command line with each mode's defaults."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, testbed shape, fp32, few configs")
    ap.add_argument("--rows", default=None, help="comma list of rows per sequence (M)")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes")
    ap.add_argument("--experts", default=None, help="comma list of our arms: bf16, w4, reference")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--rotate", type=int, default=3, help="distinct canvases cycled through")
    ap.add_argument(
        "--sc",
        choices=["none", "full", "topk"],
        default="none",
        help="self-conditioning input of the matrix runs (the profile always covers all three)",
    )
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--ref-max-batch", type=int, default=16, help="no HF reference (errors) above this batch")
    ap.add_argument("--graphs", action="store_true", help="also time DecodeGraph replays (CUDA)")
    ap.add_argument(
        "--attention",
        choices=("kernel", "sdpa"),
        default="kernel",
        help="kernel: attention with visibility from the arena, the path the worker loop's decoder steps "
        "take (default); sdpa: the mask-free SDPA call an all-visible eager forward may take",
    )
    ap.add_argument(
        "--no-hf", action="store_true", help="skip HF timings (its logits are still the reference)"
    )
    ap.add_argument(
        "--no-ref",
        action="store_true",
        help="no HF model: our W4 arms (w4, w4+fp8...) on the worker's random W4 bundle, no reference "
        "logits or HF timings (fits an 80 GiB card at the real shape; implies --no-hf)",
    )
    ap.add_argument("--torch-profile", action="store_true", help="write a torch profiler table to $OUT")
    args = ap.parse_args(argv)

    device = "cuda" if (torch.cuda.is_available() and not args.quick) else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick:
        rows, batches, arms = [32, 16, 8], [1, 2], ["bf16"]
        args.prompt = args.prompt or 48
        args.warmup = 1 if args.warmup is None else args.warmup
        args.iters = 3 if args.iters is None else args.iters
    else:
        rows, batches, arms = [256, 128, 64, 32, 16, 8], [1, 4, 16], ["bf16", "w4"]
        args.prompt = args.prompt or 128
        args.warmup = 3 if args.warmup is None else args.warmup
        args.iters = 20 if args.iters is None else args.iters
    if args.rows:
        rows = [int(x) for x in args.rows.split(",")]
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.experts:
        arms = args.experts.split(",")
    if args.no_ref:
        args.no_hf = True
        if any(not a.startswith("w4") for a in arms):
            ap.error(
                f"--no-ref: the bundle's experts are W4 packs only; --experts {','.join(arms)} asks for others"
            )
    return args, rows, batches, arms, device, dtype


EXACT_ARMS = ("bf16", "reference", "grouped")  # the weights HF runs: their error vs HF is bounded


def result_table(results: list, names: list, args, device: str, dtype) -> tuple[list[str], bool]:
    """(Markdown lines of the timing table, whether every exact arm stayed within its parity bound)."""
    # an exact arm's error is bounded; W4 quantises the weights, so its column is how far the quantised
    # model's logits sit from HF's bf16 ones (~1 on random weights, whose logits are noise), not an error
    head = ["B", "M", "HF ms"] + [f"{n} ms" for n in names]
    head += [f"{n} err" if n in EXACT_ARMS else f"{n} Δ vs bf16 HF" for n in names]
    if args.graphs and device == "cuda":
        head += [f"{n} graph ms" for n in names]
    head += [f"{n} × HF" for n in names] + [f"{n} floor %" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ok = True
    for r in results:
        cells = [str(r["batch"]), str(r["rows"]), f"{r.get('hf_ms', float('nan')):.2f}"]
        nan = float("nan")
        cells += [f"{r.get(f'{n}_ms', nan):.2f}" for n in names]
        tol = BF16_TOL if dtype == torch.bfloat16 else 1e-4
        for n in names:
            e = r.get(f"{n}_err")
            cells.append("—" if e is None else f"{e:.1e}")
            ge = r.get(f"{n}_graph_err")
            if n in EXACT_ARMS and any(x is not None and x > tol for x in (e, ge)):
                ok = False
            if f"{n}_error" in r or f"{n}_graph_error" in r:
                ok = False
        if args.graphs and device == "cuda":
            cells += [f"{r.get(f'{n}_graph_ms', float('nan')):.2f}" for n in names]
        cells += [f"{r.get('hf_ms', nan) / r.get(f'{n}_ms', nan):.1f}" for n in names]
        cells += [f"{100 * r.get(f'{n}_floor_frac', nan):.0f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines, ok


def print_report(lines: list, profile: dict, encode: dict, rows: list, args) -> None:
    print(
        f"\n## Decoder forward, {'testbed shape (CPU, fp32)' if args.quick else 'real 26B-A4B shape'}, "
        f"prompt {args.prompt}, SC {args.sc}, median of {args.iters}"
    )
    print("\n".join(lines))
    print(f"\nProfile split of one forward, ours, B=1, M={rows[0]} (ms):")
    for name, prof in profile.items():
        for label, split in prof.items():
            if isinstance(split, dict):
                print(f"- {name} / {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
            elif label == "error":
                print(f"- {name}: profile failed: {split}")
    print(
        f"\nEncoder prefill, {args.prompt} tokens: "
        + ", ".join(f"{k} {v:.2f}" for k, v in encode.items() if k.endswith("_ms"))
    )


def main(argv=None) -> dict:
    args, rows, batches, arms, device, dtype = parse_args(argv)
    model, build_s = build_model(args.quick, device, dtype, args.no_ref)
    hf_experts = getattr(model.config.get_text_config(), "_experts_implementation", None)
    runtimes = {}
    for arm in arms:
        try:
            runtimes[arm] = build_arm(model, arm)
        except Exception as e:  # noqa: BLE001 -- e.g. no Triton here: report it, run the other arms
            print(f"[forward] experts={arm} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    if not runtimes:
        raise SystemExit("no runtime arm could be built")

    results = []
    for b in batches:
        for m in rows:
            r = run_config(model, runtimes, m, b, args.prompt, args, device)
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    profile = {}
    for name, rt in runtimes.items():
        try:
            profile[name] = profile_split(rt, model, rows[0], args.prompt, args, device)
        except Exception as e:  # noqa: BLE001 -- report, keep the timings
            profile[name] = {"error": f"{type(e).__name__}: {e}"}
    encode = encode_timing(model, runtimes, args.prompt, args, device)

    lines, ok = result_table(results, list(runtimes), args, device, dtype)
    print_report(lines, profile, encode, rows, args)
    summary = {
        "bench": "forward",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "shape": "testbed" if args.quick else "26b-a4b",
        "dtype": str(dtype).replace("torch.", ""),
        "hf_experts": hf_experts,
        "build_s": round(build_s, 2),
        "parity_ok": ok,
        "first": results[0] if results else None,
        "profile": profile,
        "encode": encode,
        "results": results,
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "forward.json").write_text(json.dumps(summary, indent=1))
    keys = ("bench", "date", "commit", "device", "shape", "dtype", "parity_ok", "hf_experts", "first")
    keys += ("profile",)
    print(json.dumps({k: summary[k] for k in keys}))
    return summary


if __name__ == "__main__":
    main()
