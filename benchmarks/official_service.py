"""The official sampler through the worker's own decode loop at the real shape (label: replayed).

    python3 benchmarks/official_service.py --device cuda --batches 16,32 --n 64 --out results.json

1. Record: the official decoder on the trained testbed (this device) decodes `--n` arith + code
   problems; per request its denoising steps per canvas and its answer length are kept (accuracy too).
2. Replay: `random:26b-a4b` (W4 experts, CUDA graphs: the service defaults on a GPU) loaded like a
   worker loads it; a run of the same requests (prompt text repeated `--scale` times, max_tokens =
   recorded canvases × 256) is created in a SQLite store and drained by `Engine.process_chunk`
   with `decode_slots = batch`: continuous batching, per-row writes, the sampler's real work on real
   [rows, 262,144] logits; only the stop decisions come from the recording (`replay.OFFICIAL`).
   tok/s = recorded tokens × scale ÷ wall seconds of the chunk.
3. Bare forwards: the same number of 256-row windows per step through the graph runner alone, so the
   service loop's rows/s can be compared with the forward's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(device: str, n: int, seed: int, max_tokens: int) -> tuple[list[dict], dict]:
    from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks

    bundle = load_bundle(device=device)
    rows, correct = [], {"arith": [], "code": []}
    for task in ("arith", "code"):
        probs = tasks.generate(task, n // 2, seed)
        reqs = [
            DecodeRequest(f"{task}-{i}", bundle.encode_prompt(p.prompt, p.task), max_tokens, p.task)
            for i, p in enumerate(probs)
        ]
        res = run_batch(bundle, DecodeBatch(reqs, seed=seed), "official")
        for p, q, r in zip(probs, reqs, res):
            steps, cur = [], None
            for t in r.traces:
                if t.kind == "decode":
                    cur = (cur or 0) + 1
                elif cur is not None:
                    steps.append(cur)
                    cur = None
            if cur is not None:
                steps.append(cur)
            rows.append(
                {
                    "custom_id": q.custom_id,
                    "prompt": p.prompt,
                    "task": p.task,
                    "steps": steps,
                    "tokens": len(r.token_ids),
                }
            )
            correct[task].append(bool(tasks.verify(p, r.text)))
    acc = {k: sum(v) / max(1, len(v)) for k, v in correct.items()}
    return rows, acc


def replay(
    rows: list[dict],
    batch: int,
    scale: int,
    device: str,
    target: str,
    fp8: str = "off",
    arm: str = "official",
    arena_gib: str = "auto",
    chunk: int = 0,
) -> dict:
    import functools

    from benchmarks import replay
    from canvasq.core.schemas import Job
    from canvasq.core.settings import Settings
    from canvasq.core.store import Store
    from canvasq.decoders import base, configs
    from canvasq.model.loading import freeze_heap, load_bundle
    from canvasq.worker.engine import Engine

    global _TARGET
    if _TARGET is None:
        t0 = time.perf_counter()
        _TARGET = load_bundle(target, device=device, experts="w4")
        _TARGET.tokenizer = load_bundle(device="cpu").tokenizer  # prompts as the testbed tokenises them
        print(f"loaded {target} (W4) in {time.perf_counter() - t0:.1f}s", flush=True)
    bundle = _TARGET
    C = bundle.canvas_length
    replay.install()
    replay.OFFICIAL.clear()
    jobs = []
    for i, r in enumerate(rows):
        replay.OFFICIAL[r["custom_id"]] = r["steps"]
        jobs.append(
            Job(r["custom_id"], " ".join([r["prompt"]] * scale), r["task"], len(r["steps"]) * C, None, i + 1)
        )
    db = Path(tempfile.mkdtemp()) / "bench.sqlite"
    settings = Settings(
        database_url=f"sqlite:///{db}",
        model=target,
        device=device,
        decode_slots=batch,
        experts="w4",
        cuda_graphs="auto",
        fp8=fp8,
    )
    store = Store(settings.database_url)
    store.upgrade()
    from canvasq.decoders.bench import parse_arm

    knobs, _, rt_knobs = arm.partition("@")
    configs.CONFIGS["official"] = functools.partial(configs.OfficialConfig, **parse_arm(knobs).overrides)
    _cap_arena(bundle, fp8, settings, arena_gib)
    _runtime_knobs(bundle, fp8, settings, rt_knobs)
    engine = Engine(settings=settings, store=store, bundle=bundle, worker_id="bench:1", queue="q")
    # warm-up: the whole job set once, untimed, so the timed pass replays graphs a long-running worker
    # has already captured (window-count x context buckets); `--warm partial` warms 2 x batch rows only
    warm_jobs = jobs if WARM == "full" else jobs[: 2 * batch]
    warm = store.create_run(
        warm_jobs, model=settings.model, queue="q", decoder="official", chunk_size=chunk or len(jobs)
    )
    store.mark_published(warm.chunk_ids)
    for cid in warm.chunk_ids:  # chunked as the timed run is: the same shapes are warm
        engine.process_chunk(cid)
    freeze_heap()  # as Engine.bundle does once a worker's model is loaded (here the bundle is given)
    run = store.create_run(
        [
            Job(
                f"t{j.custom_id}",
                *[getattr(j, k) for k in ("prompt", "task", "max_tokens", "decoder", "line_no")],
            )
            for j in jobs
        ],
        model=settings.model,
        queue="q",
        decoder="official",
        chunk_size=chunk or len(jobs),
    )
    store.mark_published(run.chunk_ids)
    for r in rows:
        replay.OFFICIAL[f"t{r['custom_id']}"] = r["steps"]
    graphs = _graph_stats(bundle)
    paths = _attention_paths(bundle)
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    alloc = _alloc_counts()
    prof = (
        cProfile.Profile() if PROFILE == (batch, arm, arena_gib, chunk) else None
    )  # the profiler slows the host side
    tracer = (
        _StepTrace(TRACE, batch, *TRACE_STEPS)
        if TRACE and PROFILE_ARM == (batch, arm, arena_gib, chunk)
        else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    occ, written = [], 0
    with tracer:
        for cid in run.chunk_ids:  # a fleet worker's deliveries, in order (the first claims ahead)
            out = engine.process_chunk(cid)
            occ, written = occ + out.occupancy, written + out.written
    _sync()
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
        prof.dump_stats(f"{PROFILE_PATH}.pstats")  # for callers/callees (`python -m pstats`)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        print(f"== profile batch {batch} fp8={fp8} arm {arm} wall {wall:.2f}s", file=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        PROFILES.append(text.getvalue())
    steps = len(occ)
    live_rows = sum(n for n, _ in occ) * C
    tokens = sum(r["tokens"] for r in rows) * scale
    after = _graph_stats(bundle)
    paths = {k: v - paths.get(k, 0) for k, v in _attention_paths(bundle).items()}
    decode_s, encode_s, extra = _pass_stats(store, run.run_id, batch, C)
    errored = _errored(store, run.run_id)
    if errored:  # the recording's tokens were not committed: no throughput to report
        print(f"batch {batch} arm {arm}: {errored} of {len(rows)} rows errored", flush=True)
        tokens = 0
    return {
        "errored": errored,
        "decode_forwards_s": decode_s,
        "encode_passes_s": encode_s,
        "rest_s": wall - decode_s - encode_s,
        "batch": batch,
        "fp8": fp8,
        "arm": arm,
        "arena_gib": arena_gib,
        "window_buckets": list(base.WINDOW_BUCKETS),
        "requests": len(rows),
        "wall_s": wall,
        "tokens_replayed": tokens,
        "tok_s_replayed": tokens / wall,
        "decoder_steps": steps,
        "rows_per_s": live_rows / wall,
        "all_rows_per_s": (extra["decoder_rows"] + extra["encoder_rows"]) / wall,
        "occupancy_mean": (sum(n for n, _ in occ) / sum(s for _, s in occ)) if occ else None,
        "occupancy_full_until": next((i for i, (n, s) in enumerate(occ) if n < s), steps) / max(1, steps),
        "written": written,
        "chunk": chunk or len(jobs),
        "claims_ahead": engine.claims_ahead,
        "graphs_before": graphs,
        "graphs_after": after,
        "ms_per_step": 1000 * wall / max(1, steps),
        "eager_attention_paths": paths,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
        # the caching allocator during the drain: retries (a cudaMalloc failed, the cache was freed and
        # the malloc tried again: slow, near the card's limit), out-of-memory errors, device mallocs
        "allocator": {k: v - alloc.get(k, 0) for k, v in _alloc_counts().items()},
        **extra,
    }


def _alloc_counts() -> dict[str, int]:
    """The caching allocator's counters (CUDA; empty elsewhere)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: int(stats.get(k, 0)) for k in keys}


def _runtime_knobs(bundle, fp8: str, settings, knobs: str) -> None:
    """An arm's runtime attributes after '@' (`official@context_step=256,sdpa_backend=efficient`),
    set on the replay's runtime; attributes an arm leaves out keep the runtime's defaults. One more
    knob is the decoders' `WINDOW_BUCKETS` (window counts a graphed forward is padded up to), as
    '/'-separated counts: `official@window_buckets=1/2/4/8/12/16/20/24/28/32/40/48/56/64/96/128`."""
    from canvasq.decoders import base
    from canvasq.decoders.runtimes import runtime_for

    own = BUCKETS.setdefault("decoders", base.WINDOW_BUCKETS)  # before any arm changed them
    buckets = [v.partition("=")[2] for v in knobs.split(",") if v.partition("=")[0] == "window_buckets"]
    base.WINDOW_BUCKETS = tuple(int(b) for b in buckets[-1].split("/")) if buckets else own
    knobs = ",".join(v for v in knobs.split(",") if v.partition("=")[0] != "window_buckets")

    rt = runtime_for(bundle.hf_model, "w4", fp8, settings.fp8_min_rows)
    defaults = RUNTIME_DEFAULTS.setdefault(
        id(rt),
        {
            "context_step": rt.context_step,
            "sdpa_backend": rt.sdpa_backend,
            "encoder_sdpa_backend": rt.encoder_sdpa_backend,
            "kernel_rows": rt.kernel_rows,
            "attention_tiles": rt.attention_tiles,
            "defer_head_bytes": rt.defer_head_bytes,
            "sc_bag": rt.sc_bag,
        },
    )
    want = dict(defaults)
    for item in filter(None, knobs.split(",")):
        name, _, value = item.partition("=")
        if name not in defaults:
            raise SystemExit(f"unknown runtime knob {name!r} in arm; known: {', '.join(defaults)}")
        want[name] = type(defaults[name])(value)
    for name, value in want.items():
        setattr(rt, name, value)


RUNTIME_DEFAULTS: dict[int, dict] = {}
BUCKETS: dict[str, tuple[int, ...]] = {}  # "decoders": their WINDOW_BUCKETS, as before any arm's


def _cap_arena(bundle, fp8: str, settings, arena_gib: str) -> None:
    """The graph runner's arena cap for this arm (`--arena-gib`): a number of GiB, none (no cap: the
    stream's arena is the runner's) or auto (the runner's default, `graph.ARENA_BYTES`), optionally
    with `:ROWS`, the most padded rows a graph may take (its logits buffer; default
    `graph.LOGITS_BYTES` of fp32 logits), and `:DEFERRED`, the padded rows up to which a forward past
    ROWS still replays a graph whose LM head is deferred (default `graph.DEFERRED_ROWS`). Under the
    cap the stream allocates its own arena and runs eagerly; forwards past ROWS (and DEFERRED) on the
    runner's arena run eagerly too (e.g. 'auto,16:16384': the default against the one before it, a 16
    GiB cap with 16,384 rows of logits; 'auto,auto::8192': graphs up to 8,192 rows, the head
    deferred past the logits buffer's)."""
    from canvasq.decoders.runtimes import runtime_for
    from canvasq.model.graph import ARENA_BYTES, DEFERRED_ROWS, LOGITS_BYTES, graph_runner

    if settings.cuda_graphs == "off" or not str(settings.device).startswith("cuda"):
        return
    rt = runtime_for(bundle.hf_model, "w4", fp8, settings.fp8_min_rows)
    runner = graph_runner(rt)
    cap, _, rest = arena_gib.partition(":")
    rows, _, deferred = rest.partition(":")
    caps = {"auto": ARENA_BYTES, "none": None}
    runner.max_arena_bytes = caps[cap] if cap in caps else int(float(cap) * 2**30)
    runner.set_limits(
        int(rows) * 4 * rt.vocab_size if rows else LOGITS_BYTES, int(deferred) if deferred else DEFERRED_ROWS
    )


def _errored(store, run_id: str) -> int:
    """Rows of the run stored with an error (an out-of-memory at one slot, say)."""
    from sqlalchemy import func, select

    from canvasq.core.tables import Output

    with store.Session() as ses:
        q = select(func.count()).where(Output.run_id == run_id, Output.error_code.is_not(None))
        return int(ses.scalar(q) or 0)


def _pass_stats(store, run_id: str, batch: int, C: int) -> tuple[float, float, dict]:
    """Decoder and encoder seconds of a drained run, from its stored traces (each pass once: its trace
    rows repeat per request it carried), and the decoder ms at full slots and by window count."""
    from sqlalchemy import select

    from canvasq.core.tables import ForwardTraceRow

    with store.Session() as ses:
        passes = ses.execute(
            select(
                ForwardTraceRow.forward_index,
                ForwardTraceRow.kind,
                ForwardTraceRow.ms,
                ForwardTraceRow.rows,
                ForwardTraceRow.canvases,
            )
            .where(ForwardTraceRow.run_id == run_id)
            .distinct()
        ).all()
    decode_s = sum(ms for _, k, ms, _, _ in passes if k == "decode") / 1000
    encode_s = sum(ms for _, k, ms, _, _ in passes if k == "encode") / 1000
    # decoder forwards with every slot live (a window per canvas): comparable with the bare forward
    # of `batch` windows; with `fold_encode` some of them also carry encoder rows (`folded_rows`)
    full = sorted(ms for _, k, ms, _, n in passes if k == "decode" and n == batch)
    by_windows: dict[int, list[float]] = {}
    for _, k, ms, _, n in passes:
        if k == "decode":
            by_windows.setdefault(n, []).append(ms)
    return (
        decode_s,
        encode_s,
        {
            "full_decode_forwards": len(full),
            "full_decode_ms_median": full[len(full) // 2] if full else None,
            "decode_ms_by_windows": {w: sum(v) / len(v) for w, v in sorted(by_windows.items())},
            "folded_rows": sum(r - n * C for _, k, _, r, n in passes if k == "decode"),
            "encode_passes": sum(1 for _, k, _, _, _ in passes if k == "encode"),
            # every row the loop's forwards ran: with the wall, the loop's rate over all the work the
            # algorithm asks of it (`all_rows_per_s`), where `rows_per_s` counts the decoder's alone
            "decoder_rows": sum(r for _, k, _, r, _ in passes if k == "decode"),
            "encoder_rows": sum(r for _, k, _, r, _ in passes if k == "encode"),
        },
    )


class _StepTrace:
    """torch.profiler over a slice of the timed drain: decoder steps [wait, wait + active) with the
    encoder passes between them, labelled `decoder_step` / `encoder_pass`. Writes PATH.json (Chrome
    trace) and PATH.txt (device time by kernel and by label), to see where a step's time goes beside
    the forward: sampler kernels, mask building, host gaps."""

    def __init__(self, path: str, batch: int, wait: int = 24, active: int = 4):
        from torch.profiler import ProfilerActivity, profile, schedule

        from canvasq.decoders import base, official, slots
        from canvasq.worker import streams

        self.path, self.batch = path, batch
        self.prof = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
            on_trace_ready=self._ready,
        )
        self.patches = [
            (official.OfficialDecoder, "step", "decoder_step", True),
            (base.StepDecoder, "prefill", "encoder_pass", False),
            (official.OfficialDecoder, "_sample", "sample", False),
            (base.StepDecoder, "retire_canvases", "retire", False),
            (slots.SlotPool, "admit", "admit", False),
            (slots.SlotPool, "deliver_done", "deliver", False),
            (streams._RowStream, "flush", "store_rows", False),
        ]

    def _wrap(self, fn, label: str, tick: bool):
        prof = self.prof

        def wrapped(*a, **kw):
            with torch.profiler.record_function(label):
                out = fn(*a, **kw)
            if tick:
                prof.step()
            return out

        return wrapped

    def __enter__(self):
        from canvasq.decoders.runtimes import _RUNTIMES

        self.runtimes = [(rt, rt.scope) for per in _RUNTIMES.values() for rt in per.values()]
        for rt, _ in self.runtimes:  # the forward's own labels: attention, dense_mlp, experts, lm_head, ...
            rt.scope = torch.profiler.record_function
        self.saved = [(cls, name, getattr(cls, name)) for cls, name, _, _ in self.patches]
        for cls, name, label, tick in self.patches:
            setattr(cls, name, self._wrap(getattr(cls, name), label, tick))
        self.prof.start()
        return self

    def __exit__(self, *exc):
        self.prof.stop()
        for rt, scope in self.runtimes:
            rt.scope = scope
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)

    def _ready(self, p) -> None:
        from benchmarks.trace_gaps import analyse

        p.export_chrome_trace(self.path + ".json")
        with open(self.path + ".json") as f:
            gaps = analyse(json.load(f)["traceEvents"])
        Path(self.path + "_gaps.json").write_text(json.dumps(gaps, indent=1))
        print(json.dumps({"trace_gaps": gaps}), flush=True)
        ka = p.key_averages()
        if not torch.cuda.is_available():  # the CPU dry run: no device time to sort by
            table = ka.table(sort_by="cpu_time_total", row_limit=70)
        else:
            try:
                table = ka.table(sort_by="self_device_time_total", row_limit=70)
            except (AttributeError, KeyError):
                table = ka.table(sort_by="self_cuda_time_total", row_limit=70)
        Path(self.path + ".txt").write_text(f"batch {self.batch}\n{table}")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _graph_stats(bundle) -> dict:
    from canvasq.decoders.runtimes import _RUNTIMES

    per = _RUNTIMES.get(bundle.hf_model, {})
    return {
        str(k): {**rt.graph_runner.stats, "eager_reasons": dict(rt.graph_runner.eager_reasons)}
        for k, rt in per.items()
        if rt.graph_runner is not None
    }


def _attention_paths(bundle) -> dict:
    """Eager forwards by attention path (mask-free or masked SDPA), summed over the model's runtimes."""
    from canvasq.decoders.runtimes import _RUNTIMES

    out: dict[str, int] = {}
    for rt in _RUNTIMES.get(bundle.hf_model, {}).values():
        for k, v in rt.attention_paths.items():
            out[k] = out.get(k, 0) + v
    return out


def bare(batch: int, prompt: int, device: str, reps: int = 20, fp8: str = "off") -> dict:
    """`batch` windows of 256 rows with top-k SC through the graph runner: the forward alone, on the
    attention path the loop's decoder steps take (visibility from the arena, never the mask-free SDPA
    call that this benchmark's identical prompts would allow an eager forward). `ms_per_forward` and
    `rows_per_s` include the LM head: a deferred head's logits are made in the row groups official
    reads them in (`_head_rows`) and dropped, as an eager forward's are made whole; `*_no_head` time
    the forward without them (the body alone, which a deferred head leaves when nothing reads it)."""
    from canvasq.decoders.runtimes import runtime_for
    from canvasq.model.graph import graph_runner
    from canvasq.model.runtime import Window

    bundle = _TARGET
    from canvasq.core.settings import Settings

    rt = runtime_for(bundle.hf_model, "w4", fp8, Settings().fp8_min_rows)
    runner = graph_runner(rt)
    C, V = bundle.canvas_length, rt.vocab_size
    arena = runner.arena(max(batch, runner.store.slots if runner.store else 0), prompt + 4 * C)
    if arena is None:  # beyond the runner's arena budget: eager forwards on an arena of its own
        arena = rt.new_arena(batch, prompt + 4 * C)
    for b in range(batch):
        ids = torch.randint(0, V, (prompt,), device=device)
        runner.encode_many(arena, [(b, ids, torch.arange(prompt, device=device))])
    k = min(64, V)
    sc = (torch.randint(0, V, (C, k), device=device), torch.randn(C, k, device=device).to(rt.dtype))
    wins = [
        Window.canvas(b, torch.randint(0, V, (C,), device=device), prompt, self_cond=sc) for b in range(batch)
    ]
    for _ in range(3):
        _head_rows(runner.decode(arena, wins, prefix_attention=False), rt, C)
    _sync()
    paths = dict(rt.attention_paths)
    res: dict = {"batch": batch, "fp8": fp8}
    for head, suffix in ((True, ""), (False, "_no_head")):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = runner.decode(arena, wins, prefix_attention=False)
            if head:
                _head_rows(out, rt, C)
            _sync()
            times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        res |= {f"ms_per_forward{suffix}": med * 1000, f"rows_per_s{suffix}": batch * C / med}
    res["head_deferred"] = out.deferred  # the last timed forward's: every one has the same shape
    res["eager_attention_paths"] = {k: v - paths[k] for k, v in rt.attention_paths.items()}
    return res


def _head_rows(out, rt, C: int) -> None:
    """A deferred head's logits made (and dropped) in the row groups official's step reads them in
    (`defer_head_bytes` of fp32 a group); an eager forward's logits are already whole."""
    if not out.deferred:
        return
    rows = len(out.hidden)
    group = max(1, rt.defer_head_bytes // (4 * C * rt.vocab_size)) * C
    for g in range(0, rows, group):
        out.rows_logits(g, min(rows, g + group))


_TARGET = None
WARM = "full"
PROFILE: tuple | None = None  # (batch, arm, arena cap, chunk) of the one arm run under cProfile
PROFILE_ARM: tuple | None = (
    None  # (batch, arm, arena cap, chunk) of the one arm run under torch.profiler (`--trace`)
)
TRACE: str | None = None
TRACE_STEPS = (24, 4)  # decoder steps the trace waits, then records (`--trace-steps`)
PROFILES: list[str] = []
PROFILE_PATH = "profile"


def _live_blocks(title: str, top: int = 30) -> str:
    """The largest live CUDA blocks at an out-of-memory, each with the frames (ours first) that
    allocated it: what a 64-slot step holds when it runs out (needs `--mem-history`)."""
    snap = torch.cuda.memory._snapshot()
    blocks = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    blocks.sort(key=lambda b: -b["size"])
    total = sum(b["size"] for b in blocks)
    lines = [f"# {title}: {len(blocks)} live blocks, {total / 2**30:.2f} GiB"]
    for b in blocks[:top]:
        frames = [
            f for f in b.get("frames", []) if "canvasq" in f["filename"] or "benchmarks" in f["filename"]
        ]
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:6])
        lines.append(f"{b['size'] / 2**30:8.3f} GiB  {where}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--n", type=int, default=64, help="requests (half arith, half code)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scale", type=int, default=8, help="rows and tokens × scale (canvas 32 → 256)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--target", default="random:26b-a4b", help="the replay's model (random:testbed: a CPU dry run)"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--warm", choices=("full", "partial"), default="full")
    ap.add_argument(
        "--fp8", default="off,auto", help="CANVASQ_FP8 arms, ';'-separated when a value is a list"
    )
    ap.add_argument(
        "--arms",
        default="official",
        help="official's knob arms, ';'-separated, as canvasq bench's "
        "--arm (e.g. 'official:sampler=torch;official:sampler=fused'); runtime attributes after '@' "
        "(e.g. 'official@context_step=256,sdpa_backend=efficient'), and the window-count buckets of "
        "graphed forwards (e.g. 'official@window_buckets=1/2/4/8/12/16/20/24/28/32/40/48/56/64')",
    )
    ap.add_argument(
        "--chunks",
        default="0",
        help="chunk sizes to A/B, comma-separated, each an arm after --arms' (0: the whole set in one "
        "chunk; N: chunks of N delivered in order to one worker, which claims the later ones ahead)",
    )
    ap.add_argument(
        "--trace-steps", default="24,4", help="WAIT,ACTIVE: decoder steps before the trace and in it"
    )
    ap.add_argument(
        "--arena-gib",
        default="auto",
        help="graph runner arena caps to A/B, comma-separated "
        "(GiB, none or auto: the runner's default; CAP:ROWS also caps a graph's padded rows, larger "
        "forwards eager; CAP:ROWS:DEFERRED graphs past ROWS up to DEFERRED rows, their LM head "
        "deferred), each an arm after --arms' (e.g. 'auto,16:16384' or 'auto,auto::8192')",
    )
    ap.add_argument(
        "--profile", default=None, help="write a cProfile summary of the last arm's timed drain here"
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="torch.profiler over a few steady decoder steps of the last "
        "batch's last arm: writes TRACE.json (Chrome trace) and TRACE.txt (device time by kernel)",
    )
    ap.add_argument(
        "--mem-history",
        default=None,
        help="record CUDA allocations; on out of memory write the largest live blocks, each with "
        "the Python frames that allocated it, to this text file",
    )
    args = ap.parse_args()
    global WARM, PROFILE, PROFILE_ARM, PROFILE_PATH, TRACE, TRACE_STEPS
    WARM = args.warm
    TRACE_STEPS = tuple(int(x) for x in args.trace_steps.split(","))
    last = (
        int(args.batches.split(",")[-1]),
        args.arms.split(";")[-1],
        args.arena_gib.split(",")[-1],
        int(args.chunks.split(",")[-1]),
    )
    if args.trace:
        TRACE, PROFILE_ARM = args.trace, last
    if args.profile:  # the last arm only: the others keep unprofiled timings
        PROFILE, PROFILE_PATH = last, args.profile
    commit = (
        os.environ.get("CANVASQ_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
        ).stdout.strip()
    )
    if args.mem_history and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    rows, acc = record(args.device, args.n, args.seed, args.max_tokens)
    print(f"recorded {len(rows)} testbed schedules; accuracy {acc}", flush=True)
    report = {
        "commit": commit,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "schedule": "replayed",
        "scale": args.scale,
        "seed": args.seed,
        "testbed_accuracy": acc,
        "service": [],
        "bare": [],
    }
    arms = args.fp8.split(";") if ";" in args.fp8 else args.fp8.split(",")
    for b in [int(x) for x in args.batches.split(",")]:
        caps = args.arena_gib.split(",")
        chunks = [int(x) for x in args.chunks.split(",")]
        for fp8, arm, cap, chunk in [
            (f, a, c, k) for f in arms for a in args.arms.split(";") for c in caps for k in chunks
        ]:  # one process
            try:
                res = replay(rows, b, args.scale, args.device, args.target, fp8, arm, cap, chunk)
                print(json.dumps(res), flush=True)
                report["service"].append(res)
                prompt = int(
                    sum(
                        len(_TARGET.encode_prompt(" ".join([r["prompt"]] * args.scale), r["task"]))
                        for r in rows
                    )
                    / len(rows)
                )
                if arm != args.arms.split(";")[0] or cap != caps[0] or chunk != chunks[0]:
                    continue  # the bare forward does not depend on the decoder's knobs
                bres = bare(b, prompt, args.device, fp8=fp8)
                print(json.dumps(bres), flush=True)
                report["bare"].append(bres)
            except torch.OutOfMemoryError as exc:
                print(f"batch {b} fp8={fp8}: out of memory: {exc}", flush=True)
                report["service"].append({"batch": b, "fp8": fp8, "error": "out of memory"})
                if args.mem_history:
                    Path(args.mem_history).write_text(_live_blocks(f"batch {b} fp8={fp8} arm {arm}"))
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.profile:
        Path(args.profile).write_text("\n".join(PROFILES))
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
