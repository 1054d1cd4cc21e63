"""Decoders end to end: batched tok/s on the testbed, and real-shape replays of commit schedules.

    python3 benchmarks/decoders.py batched                  # testbed, CPU: batch 1, 4, 16
    python3 benchmarks/decoders.py replay --device cuda     # H200: record on the testbed, replay at
                                                            # random:26b-a4b shape (label: replayed)
    python3 benchmarks/decoders.py replay --device cuda --graphs   # the same, decoder passes as
                                                            # CUDA-graph replays (built untimed)
    python3 benchmarks/decoders.py live --device cuda       # the production decode loop at the real
                                                            # shape, random weights, graphs on / off
    python3 benchmarks/decoders.py replay-live --device cuda --arms "official;phcd"
                                                            # the production loop at the real shape
                                                            # on the testbed's decisions (replayed)

`batched`: for each decoder and batch size, the same n problems (same seed) decoded in chunks of
that batch size; wall tok/s, forwards per request, tokens per forward, distinct passes. Real commit
schedules (the testbed is trained), real timings on this machine.

`replay`: the numerator cannot be measured at the real shape (random weights never converge), so a
commit schedule is *recorded* on the testbed — every pass's windows (rows, canvases, context length)
— and *replayed* through our runtime at the real shape: the same passes with every row count and
context length scaled by canvas_real / canvas_testbed (256 / 32), random token ids, the arena held
at the recorded context length. Reported tok/s = recorded tokens × scale ÷ replay seconds; every
figure is labelled "replayed". The official schedule comes from its traces (C rows per denoising
step, context = prompt + committed canvases) and is replayed on the same runtime forward.

`live`: the service's own loop (`run_batch`) at the real shape on random weights and random prompt
ids, each arm timed cold (its first batch: CUDA-graph captures included) and then warm. Random
weights commit almost nothing on confidence, so the schedule is forced-accept bound (one token per
canvas per step): a worst case for tokens per forward, and a like-for-like per-step cost comparison
between arms (the graph and eager arms run the same loop; whether their tokens agree is reported).

`replay-live`: the decoder's own loop (`run_batch`: its windows, sampler work on [rows, 262,144]
logits, commits, promotions, encoder passes) at the real shape, with the decisions random weights cannot
make taken from a testbed recording: `official` stops each canvas after its recorded denoising steps
(`replay.OFFICIAL`), `phcd` commits its recorded count × scale on each forward (`replay.PHCD`; coarse
passes fall on the same forwards). Prompts are the testbed prompts' ids repeated × scale. Each arm runs
once untimed (allocations, graph captures), then timed; tok/s = recorded tokens × scale ÷ wall seconds.

Prints a Markdown table; the last line is one JSON object; with $OUT set, raw results go to
$OUT/decoders_<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.registry import make_decoder
from canvasq.decoders.runtimes import runtime_for


def _requests(bundle, task: str, n: int, seed: int, max_tokens: int) -> tuple[list, list]:
    from canvasq.testbed import tasks

    problems = tasks.generate(task, n, seed)
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems]
    return problems, reqs


def _parse_arm(spec: str) -> tuple[str, dict]:
    from canvasq.decoders.bench import parse_arm

    a = parse_arm(spec)
    return a.decoder, a.overrides


# --- batched -----------------------------------------------------------------------------------------
def batched(args) -> dict:
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks

    bundle = load_bundle(args.model, device=args.device)
    problems, reqs = _requests(bundle, args.task, args.n, args.seed, args.max_tokens)
    rows = []
    arms = args.arms.split(";")
    for bs in [int(x) for x in args.batches.split(",")]:
        order = arms if bs % 2 else list(reversed(arms))  # alternate arm order across batch sizes
        for spec in order:
            name, over = _parse_arm(spec)
            run_batch(
                bundle, DecodeBatch(reqs[:1], seed=args.seed), decoder=name, overrides=over or None
            )  # warm
            torch.manual_seed(args.seed)
            before = _graph_stats(bundle, name, over)
            res, passes, t0 = [], 0, time.perf_counter()
            for i in range(0, len(reqs), bs):
                part = run_batch(
                    bundle,
                    DecodeBatch(reqs[i : i + bs], seed=args.seed),
                    decoder=name,
                    overrides=over or None,
                )
                passes += len({t.index for r in part for t in r.traces})
                res += part
            dt = time.perf_counter() - t0
            toks = sum(len(r.token_ids) for r in res)
            fwd = sum(r.forwards for r in res)
            acc = sum(r.error is None and tasks.verify(p, r.text) for r, p in zip(res, problems)) / len(res)
            rows.append(
                {
                    "arm": spec,
                    "batch": bs,
                    "n": len(res),
                    "acc": acc,
                    "tokens": toks,
                    "seconds": dt,
                    "tok_s": toks / dt,
                    "fwd_per_req": fwd / len(res),
                    "tok_per_fwd": toks / max(fwd, 1),
                    "passes": passes,
                    "tok_per_pass": toks / max(passes, 1),
                    "graphs": _delta(_graph_stats(bundle, name, over), before),
                }
            )
            print(f"batch {bs:>3} {spec:<30} {toks / dt:8.1f} tok/s  acc {acc:.2f}", file=sys.stderr)
    return {
        "mode": "batched",
        "model": bundle.spec,
        "device": args.device,
        "task": args.task,
        "n": args.n,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "schedule": "real (testbed)",
    }


def _graph_stats(bundle, name: str, over: dict) -> dict:
    """The graph runner's counters of the runtime this arm decodes with ({} when it runs eagerly)."""
    runner = make_decoder(name, bundle, over or None).graphs
    return dict(runner.stats) if runner is not None else {}


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


# --- live --------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def live(args) -> dict:
    from canvasq.model.loading import load_bundle

    target = load_bundle(args.shape, device=args.device)
    if args.experts == "w4":
        runtime_for(target.hf_model, "w4")  # pack first, then drop the bf16 experts nobody reads
        release_bf16_experts(target.hf_model)
    V = target.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(args.seed)
    arms = args.arms.split(";")
    rows = []

    for bs in [int(x) for x in args.batches.split(",")]:
        prompts = [torch.randint(3, V, (args.prompt_len,), generator=g).tolist() for _ in range(bs)]
        reqs = [DecodeRequest(f"r{i}", p, args.max_tokens, args.task) for i, p in enumerate(prompts)]
        tokens_by_arm = {}
        for spec in arms if bs % 2 else list(reversed(arms)):
            name, over = _parse_arm(spec)
            over = {"adapter": False, "experts": args.experts, **over}
            for rep in range(args.reps + 1):  # rep 0: cold (graph captures happen here)
                before = _graph_stats(target, name, over)
                _sync(args.device)
                t0 = time.perf_counter()
                res = run_batch(target, DecodeBatch(reqs, seed=args.seed), decoder=name, overrides=over)
                _sync(args.device)
                dt = time.perf_counter() - t0
                errors = [r.error for r in res if r.error]
                passes = len({t.index for r in res for t in r.traces})
                toks = sum(len(r.token_ids) for r in res)
                tokens_by_arm[spec] = [r.token_ids for r in res]
                rows.append(
                    {
                        "arm": spec,
                        "batch": bs,
                        "rep": "cold" if rep == 0 else f"warm {rep}",
                        "seconds": dt,
                        "passes": passes,
                        "ms_per_pass": 1e3 * dt / max(passes, 1),
                        "tokens": toks,
                        "tok_s": toks / dt,
                        "errors": errors[:3],
                        "graphs": _delta(_graph_stats(target, name, over), before),
                    }
                )
                print(
                    f"batch {bs:>3} {spec:<34} {rows[-1]['rep']:<7} {1e3 * dt / max(passes, 1):7.2f} ms/pass "
                    f"{toks / dt:8.1f} tok/s  {rows[-1]['graphs']}",
                    file=sys.stderr,
                )
        same = len({json.dumps(t) for t in tokens_by_arm.values()}) == 1
        for r in rows:
            if r["batch"] == bs:
                r["tokens_equal_across_arms"] = same
    return {
        "mode": "live",
        "shape": args.shape,
        "device": args.device,
        "experts": args.experts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "rows": rows,
        "schedule": "live loop, random weights (forced-accept bound)",
    }


# --- replay-live -------------------------------------------------------------------------------------
def _replay_plan(name: str, result, scale: int, C: int) -> tuple[list[int], int]:
    """(the decoder's REPLAY entry, max_tokens at the real shape) from one testbed result."""
    if name == "official":  # denoising steps per canvas (its decode passes between encoder passes)
        steps, cur = [], 0
        for t in result.traces[1:]:  # the prefill first
            if t.kind == "decode":
                cur += 1
            elif cur:
                steps.append(cur)
                cur = 0
        steps += [cur] if cur else []
        return steps, len(steps) * C
    sizes = [(t.own_commits or 0) * scale for t in result.traces if t.kind == "decode"]
    return sizes, max(1, sum(sizes))


def _replay_report(mode: str, testbed, args, rows: list, **extra) -> dict:
    """The JSON a replay mode returns: what was recorded where, and replayed at which shape."""
    keys = ("shape", "device", "experts", "task", "n", "seed")
    head = {"mode": mode, "recorded_on": testbed.spec, **{k: getattr(args, k) for k in keys}}
    return {**head, **extra, "rows": rows, "schedule": "replayed"}


def _timed_passes(bundle, batches: list, bs: int, decoder: str, knobs: dict, seed: int, device: str):
    """Each list of requests through `run_batch` in chunks of `bs`: ([seconds per list], last results)."""
    times, res = [], []
    for batch in batches:
        _sync(device)
        t0 = time.perf_counter()
        res = []
        for i in range(0, len(batch), bs):
            res += run_batch(
                bundle, DecodeBatch(batch[i : i + bs], seed=seed), decoder=decoder, overrides=knobs
            )
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, res


def replay_live(args) -> dict:
    from benchmarks import replay
    from canvasq.model.loading import load_bundle

    replay.install()
    tables = {"official": replay.OFFICIAL, "phcd": replay.PHCD}
    testbed = load_bundle(args.model, device=args.record_device)
    # experts packed at load (W4: the packs every runtime of the model shares, no BF16 copy kept)
    target = load_bundle(args.shape, device=args.device, experts=args.experts)
    scale = target.canvas_length // testbed.canvas_length
    _, reqs = _requests(testbed, args.task, args.n, args.seed, args.max_tokens)
    rows = []

    for bs in [int(x) for x in args.batches.split(",")]:
        for spec in args.arms.split(";"):
            name, over = _parse_arm(spec)
            if name not in tables:
                raise SystemExit(f"replay-live: {name!r} has no replaying decoder (official, phcd)")
            part = reqs[:bs] if bs > 1 else reqs[: max(1, args.n // 4)]
            tables[name].clear()  # the testbed records its own schedule, not an earlier arm's
            recorded = []
            for i in range(0, len(part), bs):
                recorded += run_batch(
                    testbed,
                    DecodeBatch(part[i : i + bs], seed=args.seed),
                    decoder=name,
                    overrides=over or None,
                )
            jobs = []
            for q, r in zip(part, recorded):
                plan, max_tokens = _replay_plan(name, r, scale, target.canvas_length)
                for key in (q.custom_id, f"w{q.custom_id}"):
                    tables[name][key] = plan
                jobs.append(DecodeRequest(q.custom_id, q.prompt_ids * scale, max_tokens, q.task))
            warm = [DecodeRequest(f"w{j.custom_id}", j.prompt_ids, j.max_tokens, j.task) for j in jobs]
            knobs = (
                {"adapter": False, "experts": args.experts, **over}
                if name == "phcd"
                else {"experts": args.experts, **over}
            )
            # the first list (warm) untimed: allocations and graph captures
            times, res = _timed_passes(target, [warm, jobs], bs, name, knobs, args.seed, args.device)
            tokens = sum(len(r.token_ids) for r in recorded) * scale
            rows.append(
                {
                    "arm": spec,
                    "batch": bs,
                    "requests": len(jobs),
                    "seconds": times[1],
                    "cold_seconds": times[0],
                    "tokens_scaled": tokens,
                    "tok_s_replayed": tokens / times[1],
                    "fwd_per_req": sum(r.forwards for r in res) / len(res),
                    "errors": [r.error for r in res if r.error][:3],
                }
            )
            print(
                f"batch {bs:>3} {spec:<30} {tokens / times[1]:9.1f} tok/s (replayed)  "
                f"{rows[-1]['fwd_per_req']:.1f} fwd/req  {times[1]:.1f}s",
                file=sys.stderr,
            )
            tables[name].clear()
            if args.device.startswith("cuda"):  # the next arm's graphs and logits start from a clean pool
                torch.cuda.empty_cache()
    return _replay_report("replay-live", testbed, args, rows, scale=scale)


# --- record ------------------------------------------------------------------------------------------
def record(bundle, spec: str, reqs: list, batch: int, seed: int) -> dict:
    """Every pass a decoder makes over `reqs` in chunks of `batch`, as window sizes."""
    name, over = _parse_arm(spec)
    passes, tokens = [], 0
    if name == "official":
        C = bundle.canvas_length
        for i in range(0, len(reqs), batch):
            part = run_batch(
                bundle, DecodeBatch(reqs[i : i + batch], seed=seed), decoder=name, overrides=over or None
            )
            tokens += sum(len(r.token_ids) for r in part)
            by_index: dict[int, dict] = {}
            ctx = {r.custom_id: 0 for r in part}
            for r in part:
                for t in r.traces:
                    p = by_index.setdefault(t.index, {"kind": t.kind, "windows": []})
                    p["windows"].append({"rows": t.own_rows, "canvases": 1, "ctx": ctx[r.custom_id]})
                    if t.kind == "encode":  # the committed rows join this request's context
                        ctx[r.custom_id] += t.own_rows
            passes += [by_index[k] for k in sorted(by_index)]
        return {
            "decoder": spec,
            "canvas_length": C,
            "tokens": tokens,
            "requests": len(reqs),
            "passes": passes,
        }

    dec = make_decoder(name, bundle, over or None)
    rt = dec.rt
    real_decode, real_encode = rt.decode, rt.encode_many

    def spy_decode(arena, windows, **kw):
        passes.append(
            {
                "kind": "decode",
                "windows": [
                    {
                        "rows": w.rows,
                        "canvases": len(set(w.canvas_start.tolist())),
                        "ctx": arena.length[w.slot],
                    }
                    for w in windows
                ],
            }
        )
        return real_decode(arena, windows, **kw)

    def spy_encode(arena, items):
        passes.append(
            {
                "kind": "encode",
                "windows": [
                    {"rows": int(ids.numel()), "canvases": 1, "ctx": arena.length[slot]}
                    for slot, ids, _ in items
                ],
            }
        )
        return real_encode(arena, items)

    rt.decode, rt.encode_many = spy_decode, spy_encode
    try:
        for i in range(0, len(reqs), batch):
            part = dec.decode(DecodeBatch(reqs[i : i + batch], seed=seed))
            tokens += sum(len(r.token_ids) for r in part)
    finally:
        del rt.decode, rt.encode_many
    return {
        "decoder": spec,
        "canvas_length": bundle.canvas_length,
        "tokens": tokens,
        "requests": len(reqs),
        "passes": passes,
    }


# --- replay ------------------------------------------------------------------------------------------
@torch.no_grad()
def _pass_inputs(p: dict, scaled, arena, V: int, g: torch.Generator, device: str):
    """One recorded pass at the replay's shape, random ids: (decoder windows, encoder items); each
    slot's arena length set to the window's scaled context."""
    from canvasq.model.runtime import Window

    wins, items = [], []
    for slot, w in enumerate(p["windows"]):
        ctx, r = scaled(w)
        arena.length[slot] = ctx
        ids = torch.randint(0, V, (r,), generator=g).to(device)
        pos = torch.arange(ctx, ctx + r, device=device)
        if p["kind"] == "encode":
            items.append((slot, ids, pos))
            continue
        blk = -(-r // max(1, int(w["canvases"])))
        start = ctx + (torch.arange(r, device=device) // blk) * blk
        wins.append(Window(slot, ids, pos, start, torch.clamp(start + blk, max=ctx + r)))
    return wins, items


def replay(rt, schedule: dict, canvas_length: int, device: str, reps: int = 1, graphs: bool = False) -> dict:
    """Time the schedule's passes at `rt`'s shape with rows and context scaled by the canvas ratio.

    `graphs`: decoder passes go through `DecodeGraph`s, one per (slots, row bucket, context bucket),
    built during an untimed warm-up repetition (a service builds them once per bucket); on CUDA each
    pass is then one graph launch. Encoder passes stay eager."""
    from canvasq.model.graph import ROW_BUCKETS, DecodeGraph, _bucket, context_bucket

    scale = canvas_length / schedule["canvas_length"]
    passes = schedule["passes"]
    width = max(len(p["windows"]) for p in passes)

    def scaled(w):
        return int(w["ctx"] * scale), max(1, round(w["rows"] * scale))

    def room(p):  # a graph pads every window of a pass to the bucket of its largest one
        sizes = [scaled(w) for w in p["windows"]]
        return max(c for c, _ in sizes) + _bucket(max(r for _, r in sizes), ROW_BUCKETS)

    cap = max(room(p) for p in passes) + 8
    arena = rt.new_arena(slots=width, capacity=cap)
    g = torch.Generator(device="cpu").manual_seed(0)
    for layer in range(arena.num_layers):  # random context K/V: only its length matters for cost
        arena.k[layer].normal_(generator=None)
        arena.v[layer].normal_(generator=None)
    arena.pos[:] = torch.arange(cap, device=arena.pos.device)[None]
    V = rt.vocab_size
    rows_total = 0

    cache: dict[tuple, DecodeGraph] = {}
    pool = torch.cuda.graph_pool_handle() if graphs and device.startswith("cuda") else None

    def decode(wins):
        if not graphs:
            return rt.decode(arena, wins)
        rows = _bucket(max(w.rows for w in wins), ROW_BUCKETS)
        need = max(arena.length[w.slot] for w in wins) + rows
        context = context_bucket(need, cap)
        key = (tuple(w.slot for w in wins), rows, context)
        if key not in cache:
            cache[key] = DecodeGraph(rt, arena, wins, rows=rows, context=context, pool=pool)
        return cache[key].run(wins)

    best = None
    for rep in range(reps + int(graphs)):  # with graphs, repetition 0 builds them (untimed)
        _sync(device)
        t0 = time.perf_counter()
        for p in passes:
            wins, items = _pass_inputs(p, scaled, arena, V, g, device)
            rows_total += sum(len(w.token_ids) for w in wins)
            if items:
                rt.encode_many(arena, items)
            if wins:
                decode(wins)
        _sync(device)
        dt = time.perf_counter() - t0
        if graphs and rep == 0:
            rows_total = 0
            continue
        best = dt if best is None else min(best, dt)
    tokens = schedule["tokens"] * scale
    return {
        "decoder": schedule["decoder"],
        "label": "replayed",
        "scale": scale,
        "passes": len(passes),
        "seconds": best,
        "tokens_scaled": tokens,
        "tok_s_replayed": tokens / best,
        "ms_per_pass": 1e3 * best / len(passes),
        "rows_per_pass": rows_total / max(reps, 1) / len(passes),
        "forward": f"CUDA graphs ({len(cache)} buckets)" if graphs else "eager",
    }


def release_bf16_experts(hf_model) -> None:
    """Drop the model-dtype expert weights once the W4 runtime has packed them (shared Parameters: the
    runtime's bf16 references empty too, and the W4 path never reads them)."""
    for name, p in hf_model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.data = p.data.new_empty(0)
    torch.cuda.empty_cache()


def replay_mode(args) -> dict:
    from canvasq.model.loading import load_bundle

    testbed = load_bundle(args.model, device=args.record_device)
    _, reqs = _requests(testbed, args.task, args.n, args.seed, args.max_tokens)
    target = load_bundle(args.shape, device=args.device)
    out = []
    for bs in [int(x) for x in args.batches.split(",")]:
        for spec in args.arms.split(";"):
            sched = record(testbed, spec, reqs[: max(bs, args.n)], bs, args.seed)
            rt = runtime_for(target.hf_model, args.experts)  # our runtime over the target's weights
            if args.experts == "w4":
                release_bf16_experts(target.hf_model)  # replays never read them: 42.5 GiB at the real shape
            res = replay(rt, sched, target.canvas_length, args.device, reps=args.reps, graphs=args.graphs)
            res.update({"batch": bs, "requests": sched["requests"], "testbed_tokens": sched["tokens"]})
            out.append(res)
            print(
                f"batch {bs:>3} {spec:<30} {res['tok_s_replayed']:9.1f} tok/s (replayed)  "
                f"{res['ms_per_pass']:.1f} ms/pass",
                file=sys.stderr,
            )
    return _replay_report("replay", testbed, args, out)


def table(report: dict) -> str:
    if report["mode"] == "replay-live":
        head = "| arm | batch | requests | fwd/req | seconds | tok/s (replayed) |\n|---|---|---|---|---|---|"
        body = [
            f"| {r['arm']} | {r['batch']} | {r['requests']} | {r['fwd_per_req']:.1f} | {r['seconds']:.2f} | "
            f"{r['tok_s_replayed']:.1f} |"
            for r in report["rows"]
        ]
        return "\n".join([head, *body])
    if report["mode"] == "live":
        head = "| arm | batch | run | passes | ms/pass | tok/s | graphs built / replayed / eager |\n|---|---|---|---|---|---|---|"
        body = [
            f"| {r['arm']} | {r['batch']} | {r['rep']} | {r['passes']} | {r['ms_per_pass']:.2f} | {r['tok_s']:.1f} | "
            + (
                " / ".join(str(r["graphs"].get(k, 0)) for k in ("built", "replayed", "eager"))
                if r["graphs"]
                else "off"
            )
            + " |"
            for r in report["rows"]
        ]
        return "\n".join([head, *body])
    if report["mode"] == "batched":
        head = "| arm | batch | n | acc | tok/s | fwd/req | tok/fwd | passes | tok/pass |\n|---|---|---|---|---|---|---|---|---|"
        body = [
            f"| {r['arm']} | {r['batch']} | {r['n']} | {r['acc']:.2f} | {r['tok_s']:.1f} | {r['fwd_per_req']:.1f} | "
            f"{r['tok_per_fwd']:.2f} | {r['passes']} | {r['tok_per_pass']:.1f} |"
            for r in report["rows"]
        ]
    else:
        head = (
            "| arm | batch | passes | ms/pass | rows/pass | tok/s (replayed) | forward |\n"
            "|---|---|---|---|---|---|---|"
        )
        body = [
            f"| {r['decoder']} | {r['batch']} | {r['passes']} | {r['ms_per_pass']:.2f} | {r['rows_per_pass']:.0f} | "
            f"{r['tok_s_replayed']:.1f} | {r['forward']} |"
            for r in report["rows"]
        ]
    return "\n".join([head, *body])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["batched", "replay", "live", "replay-live"])
    ap.add_argument("--model", default=None, help="testbed checkpoint (default models/testbed)")
    ap.add_argument("--arms", default="official;pipe;funnel", help="';'-separated decoder[:k=v,...]")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--record-device", default="cpu")
    ap.add_argument("--shape", default="random:26b-a4b")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--experts", default="bf16", choices=["bf16", "w4"], help="replay: experts of the target")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--graphs", action="store_true", help="replay: decoder passes as CUDA-graph replays")
    ap.add_argument("--prompt-len", type=int, default=128, help="live: random prompt length")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"batched": batched, "replay": replay_mode, "live": live, "replay-live": replay_live}[args.mode](
        args
    )
    report.update(
        {
            "host": platform.node(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        }
    )
    print(table(report))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"decoders_{args.mode}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
