"""Same-process A/B over decoders (and BF16 vs W4 experts): `canvasq bench`.

Measurement rules (those of BENCHMARKS.md's tables): one process, seed reset per arm, counterbalanced order (ABBA:
arms run forward on even (task, seed) blocks and reversed on odd ones), n and seeds reported.
Accuracy comes from the task suite's verifiers (`suite.generate / verify`: the CLI passes
`canvasq.testbed.tasks`; the decoders never import the testbed).

Columns:
    acc          verified / n
    tok/s        generated tokens ÷ wall seconds of the arm's run_batch calls
    fwd/req      model passes that served a request (decoder steps + encoder passes, prefill incl.)
    passes       distinct model passes (a batched pass serves several requests once)
    tok/fwd      generated tokens ÷ Σ fwd/req  (the numerator per request)
    rows/fwd     Σ rows a request put into its passes ÷ its passes  (G per request-forward)
    G/τ          Σ rows ÷ generated tokens  (rows of compute per produced token)
    GFLOP/tok    G/τ × matmul FLOPs of one row at the 26B-A4B shape (`flops_per_row`; G/τ is the same
                 at the real shape: a replay scales rows and tokens alike); `flop_per_tok` in the JSON
                 is the same on the bench's own model
    TTFT / TTFW  mean milliseconds of a request's passes until its final prefix held one token / one
                 canvas (`stats["first_token_pass"]` / `["first_window_pass"]`; within its batch)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Arm:
    label: str
    decoder: str
    overrides: dict = field(default_factory=dict)


def parse_arm(spec: str) -> Arm:
    """`funnel`, `pipe:tau_conf=0.85,tau_eos=0.5`, `official:experts=w4` (values parsed as JSON
    when they parse, else kept as strings)."""
    name, _, rest = spec.partition(":")
    over = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            over[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            over[k.strip()] = v.strip()
    return Arm(spec, name.strip(), over)


@dataclass
class ArmStats:
    label: str
    n: int = 0
    correct: int = 0
    tokens: int = 0
    seconds: float = 0.0
    fwd_req: int = 0
    passes: int = 0
    rows: int = 0
    errors: int = 0
    ttft_ms: float = 0.0  # Σ over requests
    ttfw_ms: float = 0.0
    flops_row: float = 0.0  # matmul FLOPs of one row on the bench's model
    per_task: dict = field(default_factory=dict)

    def add(self, task: str, results, problems, seconds: float, verify, passes: int) -> None:
        t = self.per_task.setdefault(
            task, {"n": 0, "correct": 0, "tokens": 0, "seconds": 0.0, "fwd_req": 0, "rows": 0}
        )
        for r, p in zip(results, problems):
            ok = r.error is None and verify(p, r.text)
            self.n += 1
            t["n"] += 1
            self.correct += ok
            t["correct"] += ok
            self.errors += r.error is not None
            self.tokens += len(r.token_ids)
            t["tokens"] += len(r.token_ids)
            self.fwd_req += r.forwards
            t["fwd_req"] += r.forwards
            rows = sum(x.own_rows or 0 for x in r.traces)
            self.rows += rows
            t["rows"] += rows
            for key, mark in (("ttft_ms", "first_token_pass"), ("ttfw_ms", "first_window_pass")):
                ms = sum(x.ms for x in r.traces[: r.stats.get(mark, len(r.traces))])
                setattr(self, key, getattr(self, key) + ms)
                t[key] = t.get(key, 0.0) + ms
        self.passes += passes
        self.seconds += seconds
        t["seconds"] += seconds

    def row(self) -> dict:
        return {
            "arm": self.label,
            "n": self.n,
            "acc": self.correct / max(self.n, 1),
            "tok_s": self.tokens / max(self.seconds, 1e-9),
            "fwd_per_req": self.fwd_req / max(self.n, 1),
            "passes": self.passes,
            "tok_per_fwd": self.tokens / max(self.fwd_req, 1),
            "rows_per_fwd": self.rows / max(self.fwd_req, 1),
            "g_over_tau": self.rows / max(self.tokens, 1),
            "flop_per_tok": self.flops_row * self.rows / max(self.tokens, 1),
            "gflop_per_tok_26b": flops_per_row(REAL_SHAPE) * self.rows / max(self.tokens, 1) / 1e9,
            "ttft_ms": self.ttft_ms / max(self.n, 1),
            "ttfw_ms": self.ttfw_ms / max(self.n, 1),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "errors": self.errors,
            "per_task": {
                k: {**v, "acc": v["correct"] / max(v["n"], 1), "tok_s": v["tokens"] / max(v["seconds"], 1e-9)}
                for k, v in self.per_task.items()
            },
        }


def run_bench(
    bundle,
    arms: list[Arm],
    task_names: list[str],
    n: int,
    seeds: list[int],
    batch_size: int = 8,
    max_tokens: int = 128,
    progress=None,
    calibration=None,
    budget: float | None = None,
    *,
    suite,
    split: str = "eval",
) -> dict:
    """`calibration` / `budget`: what an `auto` arm routes by (`routing.route`). `suite`: the task
    families, `generate(task, n, seed, split) -> problems` (`.uid`, `.prompt`) and `verify(problem, text)`;
    `split`: "eval", or "dev" for a calibration."""
    import torch

    from canvasq.decoders.types import DecodeRequest

    stats = {a.label: ArmStats(a.label, flops_row=model_flops_per_row(bundle.hf_model)) for a in arms}
    order_log = []
    block = 0
    routed = {"calibration": calibration, "budget": budget}
    _warm(bundle, arms, suite.generate(task_names[0], 1, 10_000, split=split)[0], task_names[0], routed)
    for task in task_names:
        for seed in seeds:
            problems = suite.generate(task, n, seed, split=split)
            reqs = [
                DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems
            ]
            ordered = arms if block % 2 == 0 else list(reversed(arms))  # ABBA across blocks
            order_log.append({"task": task, "seed": seed, "order": [a.label for a in ordered]})
            for a in ordered:
                torch.manual_seed(seed)  # seed reset per arm
                t0 = time.perf_counter()
                results, passes = _run_arm(bundle, a, reqs, seed, batch_size, routed)
                dt = time.perf_counter() - t0
                stats[a.label].add(task, results, problems, dt, suite.verify, passes)
                if progress:
                    progress(f"{task} seed={seed} {a.label}: {dt:.1f}s")
            block += 1
    return {
        "model": bundle.spec,
        "device": str(bundle.device),
        **_provenance(bundle.device),
        "tasks": task_names,
        "n": n,
        "seeds": seeds,
        "split": split,
        "batch_size": batch_size,
        "max_tokens": max_tokens,
        "order": order_log,
        "arms": [stats[a.label].row() for a in arms],
    }


def _warm(bundle, arms: list[Arm], problem, task: str, routed: dict) -> None:
    """One request per arm outside the clock: first-call allocations and lazy merges (d2f_model, W4
    packing, graph captures)."""
    from canvasq.decoders import run_batch
    from canvasq.decoders.types import DecodeBatch, DecodeRequest

    req = DecodeRequest("warm", bundle.encode_prompt(problem.prompt, task), bundle.canvas_length, task)
    for a in arms:
        run_batch(
            bundle, DecodeBatch([req], seed=0), decoder=a.decoder, overrides=a.overrides or None, **routed
        )


def _run_arm(bundle, arm: Arm, reqs: list, seed: int, batch_size: int, routed: dict) -> tuple[list, int]:
    """One arm over one (task, seed) block in `run_batch` calls of `batch_size`: its results and the
    distinct model passes they took (a batched pass serves several requests once)."""
    from canvasq.decoders import run_batch
    from canvasq.decoders.types import DecodeBatch

    results, passes = [], 0
    for i in range(0, len(reqs), batch_size):
        batch = DecodeBatch(reqs[i : i + batch_size], seed=seed)
        part = run_batch(bundle, batch, decoder=arm.decoder, overrides=arm.overrides or None, **routed)
        passes += len({x.index for r in part for x in r.traces})  # distinct passes of this call
        results += part
    return results, passes


def model_flops_per_row(hf_model) -> float:
    """`flops_per_row` of a loaded model, from its weights: every matrix once (tied encoder / decoder
    and embedding / LM head share tensors), the experts at their top-k share; no vision tower."""
    t = hf_model.config.get_text_config()
    share, total, seen = t.top_k_experts / t.num_experts, 0.0, set()
    for name, p in hf_model.named_parameters():
        if p.dim() < 2 or "vision" in name or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * (share if ".experts." in name else 1.0)
    return 2.0 * total


def flops_per_row(shape) -> float:
    """Matmul FLOPs of one row (2 × the weights it multiplies): attention projections, dense MLP,
    router, self-conditioning, its top-k share of the experts and the LM head. Attention scores, which
    grow with the context, are left out, so this is a floor that rows of every decoder share."""
    c = shape.param_counts()
    dense = c["attention"] + c["dense_mlp"] + c["router"] + c["self_conditioning"] + c["embedding"]
    return 2.0 * (dense + c["experts"] * shape.top_k_experts / shape.num_experts)


class _RealShape:
    """`REAL_SHAPE`: the 26B-A4B shape, imported on first use (the CLI's --help stays light)."""

    def __getattr__(self, name):
        from canvasq.model.shapes import REAL_26B_A4B

        return getattr(REAL_26B_A4B, name)

    def param_counts(self):
        from canvasq.model.shapes import REAL_26B_A4B

        return REAL_26B_A4B.param_counts()


REAL_SHAPE = _RealShape()


def _provenance(device) -> dict:
    """When, where and on what code a bench ran (every figure names its hardware and commit)."""
    import datetime
    import os
    import platform

    import torch

    from canvasq.provenance import git_commit

    if str(device).startswith("cuda"):
        hardware = torch.cuda.get_device_name(torch.device(device))
    else:
        hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": hardware,
        "torch": torch.__version__,
        "commit": git_commit(),
    }


def markdown(report: dict, baseline: str | None = None) -> str:
    rows = report["arms"]
    base = next((r for r in rows if r["arm"] == baseline), rows[0])
    lines = [
        f"# canvasq bench — {report['model']} on {report['device']}",
        "",
        (
            f"{report.get('date', '?')}; {report.get('hardware', '?')}; torch {report.get('torch', '?')}; "
            f"commit {report.get('commit', '?')}."
        ),
        "",
        (
            f"tasks {', '.join(report['tasks'])}; n = {report['n']} per task per seed; seeds {report['seeds']}; "
            f"batch {report['batch_size']}; max_tokens {report['max_tokens']}; order ABBA across (task, seed) "
            f"blocks; baseline `{base['arm']}`; commit schedules real (not replayed)."
        ),
        "",
        (
            "| arm | n | acc | tok/s | × base | fwd/req | × fewer | tok/fwd | rows/fwd | G/τ | GFLOP/tok (26B) "
            "| TTFT ms | TTFW ms |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['n']} | {r['acc']:.3f} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / max(base['tok_s'], 1e-9):.2f} | {r['fwd_per_req']:.1f} | "
            f"{base['fwd_per_req'] / max(r['fwd_per_req'], 1e-9):.2f} | {r['tok_per_fwd']:.2f} | "
            f"{r['rows_per_fwd']:.1f} | {r['g_over_tau']:.2f} | {r.get('gflop_per_tok_26b', 0):.1f} | "
            f"{r.get('ttft_ms', 0):.0f} | {r.get('ttfw_ms', 0):.0f} |"
        )
    lines += [
        "",
        "Per task:",
        "",
        "| arm | task | n | acc | tok/s | fwd/req | tok/fwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for task, t in r["per_task"].items():
            lines.append(
                f"| {r['arm']} | {task} | {t['n']} | {t['acc']:.3f} | {t['tok_s']:.1f} | "
                f"{t['fwd_req'] / max(t['n'], 1):.1f} | {t['tokens'] / max(t['fwd_req'], 1):.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["arms"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        axes[0].scatter(r["tok_s"], r["acc"], s=60)
        axes[0].annotate(r["arm"], (r["tok_s"], r["acc"]), fontsize=8)
    axes[0].set_xlabel("wall tok/s")
    axes[0].set_ylabel("accuracy")
    axes[0].set_title("accuracy vs speed")
    labels = [r["arm"] for r in rows]
    axes[1].bar(labels, [r["tok_per_fwd"] for r in rows])
    axes[1].set_ylabel("tokens per forward")
    axes[1].set_title("numerator (every pass counted)")
    axes[1].tick_params(axis="x", rotation=30)
    fig.suptitle(f"{report['model']} · n={report['n']} · seeds {report['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(report: dict, out_dir: Path, baseline: str | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "bench.md"
    md.write_text(markdown(report, baseline))
    png = out_dir / "bench.png"
    plot(report, png)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    return md, png


def summary_json(report: dict) -> str:
    slim = {k: v for k, v in report.items() if k != "order"}
    slim["arms"] = [{k: v for k, v in r.items() if k != "per_task"} for r in report["arms"]]
    return json.dumps(slim)


__all__ = ["Arm", "markdown", "parse_arm", "plot", "run_bench", "save", "summary_json"]
