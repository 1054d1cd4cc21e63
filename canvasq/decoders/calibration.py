"""Per-model calibration of the decoders (`canvasq calibrate`) and what `--decoder auto` reads from it.

Flow: model spec → identity (resolved path, weights fingerprint) → sweep: each setting of `SWEEP` on
each task family's dev set (the testbed's dev split, disjoint from eval) through `bench.run_bench`
(one process, ABBA order, batch `batch_size`) → one `Point` per (task, setting): accuracy, committed
tok/s at that batch, forwards per request, τ (tokens per forward), G/τ (rows per token) → frontier
per family and decoder → SQL (`canvasq.core.calibrations`; the decoders know no SQL) → `Calibration`,
loaded once per worker process → `routing.route`.

The reference of a family is `official` at the checkpoint's own sampler settings (no knobs): routing
may pick any setting whose calibrated accuracy is within the budget of it (with 95 % confidence at the
dev set's size), and takes the fastest (one that does less work per token and is measured at least
`MIN_GAIN` faster than the reference).
Nothing here imports torch at module level (the worker and `canvasq config` read calibrations).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from canvasq.decoders.configs import knobs_label

# Dev seeds: distinct from the eval seeds of BENCHMARKS.md's accuracy tables (1-3, 21-23, 31-33).
DEV_SEEDS = (101,)
DEV_N = 40

# The default sweep: each decoder's main knobs and a few guards (official: the step cap per canvas
# and stop rule; pipe / funnel: τ_conf, the seed's semi canvases against the default draft-only
# pipelining, canvases in flight, the entropy budget, agree).
SWEEP: dict[str, tuple[dict, ...]] = {
    "official": (
        {},
        {"max_denoising_steps": 1},
        {"max_denoising_steps": 2},
        {"max_denoising_steps": 3},
        {"max_denoising_steps": 4},
        {"confidence_threshold": 0.05},
        {"entropy_bound": 1.0},
    ),
    "pipe": (
        {"draft_only": False},
        {},
        {"tau_conf": 0.8},  # above the capped official line on the testbed's code (BENCHMARKS.md)
        {"tau_conf": 0.97},
        {"entropy_budget": 0.1},
        {"tau_conf": 0.97, "max_canvases": 1},
    ),
    "funnel": (
        {"draft_only": False},
        {},
        {"tau_conf": 0.9},
        {"tau_conf": 0.97},
        {"tau_conf": 0.9, "entropy_budget": 0.1, "agree": True},
    ),
}

W4_DIRNAME = "canvasq_w4"  # the W4 pack cache beside a checkpoint is not part of its identity
# nor is phcd's opt-in repair adapter (`phcd:adapter=repair`): it changes no calibrated decoder
NOT_IDENTITY = (W4_DIRNAME, "phcd_adapter")


def model_identity(spec: str) -> tuple[str, str]:
    """(path, fingerprint) of a model spec. The fingerprint hashes config.json and every safetensors
    file's relative name and size (the D2F adapter's too), so retrained weights get a new identity
    while a copy, a W4 pack cache or phcd's repair adapter beside the checkpoint does not."""
    if spec.startswith("random:"):
        return spec, "random"
    d = Path(spec).expanduser().resolve()
    h = hashlib.sha256()
    h.update((d / "config.json").read_bytes())
    for p in sorted(d.rglob("*.safetensors")):
        rel = p.relative_to(d)
        if rel.parts[0] in NOT_IDENTITY:
            continue
        h.update(f"{rel.as_posix()}:{p.stat().st_size};".encode())
    return str(d), h.hexdigest()[:32]


def family_of(task: str) -> str:
    from canvasq.decoders.routing import task_kind

    return task_kind(task) or task


MIN_GAIN = 0.10  # measured tok/s a setting needs above the reference's to be routed to
WORK_MARGIN = 0.01  # relative difference in τ or G/τ that counts as less work
CONFIDENCE_Z = 1.645  # one-sided 95 %: the budget holds for the accuracy, not only for the dev sample's


def accuracy_bound(p: Point, ref: Point) -> float:
    """Points by which `p` is at least as accurate as `ref` with one-sided 95 % confidence: the
    measured difference less `CONFIDENCE_Z` standard errors of it (two independent proportions).
    Fresh seeds showed why: a setting equal to the reference on 100 dev problems per family
    (official, confidence_threshold 0.05, math) lost 2.3 points on 600 new ones."""
    var = p.accuracy * (1 - p.accuracy) / max(p.n, 1) + ref.accuracy * (1 - ref.accuracy) / max(ref.n, 1)
    return 100 * (p.accuracy - ref.accuracy - CONFIDENCE_Z * math.sqrt(var))


def does_less_work(p: Point, ref: Point) -> bool:
    """More tokens committed per forward (τ) or fewer rows computed per committed token (G/τ) than
    `ref`: the only ways a setting is faster, bandwidth-bound (cost per forward) or compute-bound
    (cost per row). Equal work measured faster is noise."""
    return p.tau > ref.tau * (1 + WORK_MARGIN) or p.g_over_tau < ref.g_over_tau * (1 - WORK_MARGIN)


@dataclass(frozen=True)
class Point:
    family: str
    task: str
    decoder: str
    knobs: dict
    n: int
    accuracy: float  # 0..1
    tok_s: float  # committed tokens per wall second at the calibration's batch size
    fwd_per_req: float
    tau: float  # tokens per forward
    g_over_tau: float  # rows of compute per committed token
    frontier: bool = False
    reference: bool = False

    @property
    def label(self) -> str:
        return knobs_label(self.decoder, self.knobs)


@dataclass(frozen=True)
class Calibration:
    model_path: str
    fingerprint: str
    device: str
    batch_size: int
    n: int
    seeds: tuple[int, ...]
    max_tokens: int
    points: tuple[Point, ...]
    hardware: str = ""
    commit: str = ""
    created_at: str = ""
    id: int | None = None
    _by_family: dict = field(default_factory=dict, compare=False, repr=False)

    def families(self) -> list[str]:
        return sorted({p.family for p in self.points})

    def family_points(self, family: str) -> list[Point]:
        if family not in self._by_family:
            self._by_family[family] = [p for p in self.points if p.family == family]
        return self._by_family[family]

    def reference(self, family: str) -> Point | None:
        """`official` at the checkpoint's sampler settings on this family."""
        return next((p for p in self.family_points(family) if p.reference), None)

    def choose(self, family: str, budget: float) -> Point | None:
        """The fastest setting within `budget` accuracy points of the reference (the reference itself
        when nothing else qualifies); None when the family has no reference.

        Both measures are samples. Accuracy: a setting qualifies when its accuracy less the
        reference's, lowered by `CONFIDENCE_Z` standard errors of that difference, is within `budget`
        (`accuracy_bound`), so a small dev set routes only to settings whose cost it can resolve.
        Speed: wall tok/s is noise-prone (arms doing identical work differ by 10 % and more on a shared
        machine), so a setting displaces the reference only if it does less work per committed token
        (`does_less_work`) and its measured tok/s beats the reference's by `MIN_GAIN`."""
        ref = self.reference(family)
        if ref is None:
            return None
        ok = [
            p
            for p in self.family_points(family)
            if p.decoder != "hf"
            and (p.reference or (accuracy_bound(p, ref) >= -budget - 1e-9 and does_less_work(p, ref)))
        ]
        return max(ok, key=lambda p: (p.tok_s * (1 + MIN_GAIN) if p.reference else p.tok_s, p.reference))

    def official_line(self, family: str, fwd: float) -> float | None:
        """Accuracy (0..1) of the capped official sampler at `fwd` forwards per request: linear
        between its measured step caps and the uncapped reference, the best so far past them; None
        below the smallest cap's forwards."""
        line = sorted(
            (p.fwd_per_req, p.accuracy)
            for p in self.family_points(family)
            if p.decoder == "official" and set(p.knobs) <= {"max_denoising_steps"}
        )
        if not line or fwd < line[0][0]:
            return None
        best = line[0][1]
        for (f0, a0), (f1, a1) in itertools.pairwise(line):
            if f0 <= fwd <= f1 and f1 > f0:
                return max(best, a0 + (a1 - a0) * (fwd - f0) / (f1 - f0))
            best = max(best, a1)
        return best

    def describe(self) -> str:
        return (
            f"calibration #{self.id} ({self.created_at}, {self.device}, batch {self.batch_size}, "
            f"n {self.n} x seeds {list(self.seeds)})"
        )


def frontier_flags(points: list[Point]) -> list[Point]:
    """Mark each point that no other point of the same family and decoder beats on both accuracy and
    tok/s (ties on both keep both)."""
    import dataclasses

    out = []
    for p in points:
        peers = [q for q in points if q.family == p.family and q.decoder == p.decoder and q is not p]
        dominated = any(
            q.accuracy >= p.accuracy and q.tok_s >= p.tok_s and (q.accuracy > p.accuracy or q.tok_s > p.tok_s)
            for q in peers
        )
        out.append(dataclasses.replace(p, frontier=not dominated))
    return out


# -- the sweep (torch) -------------------------------------------------------------------------------
def default_arms(decoders: list[str] | None = None) -> list:
    from canvasq.decoders.bench import Arm

    return [
        Arm(knobs_label(d, k), d, dict(k)) for d in SWEEP if not decoders or d in decoders for k in SWEEP[d]
    ]


def run_sweep(
    bundle,
    arms: list,
    tasks: list[str],
    n: int,
    seeds: list[int],
    batch_size: int,
    max_tokens: int,
    progress=None,
    *,
    suite,
) -> tuple[Calibration, dict]:
    """Measure every arm on every task's dev set (`suite`: the task families, as `bench.run_bench`
    takes them); the Calibration (unsaved) and the bench report."""
    from canvasq.decoders.bench import run_bench

    if not any(a.decoder == "official" and not a.overrides for a in arms):
        from canvasq.decoders.bench import Arm

        arms = [Arm("official", "official", {}), *arms]  # the reference is always measured
    report = run_bench(
        bundle,
        arms,
        tasks,
        n=n,
        seeds=seeds,
        batch_size=batch_size,
        max_tokens=max_tokens,
        progress=progress,
        suite=suite,
        split="dev",
    )
    points = _points(report, arms)
    path, fp = model_identity(bundle.spec)
    cal = Calibration(
        model_path=path,
        fingerprint=fp,
        device=str(bundle.device),
        batch_size=batch_size,
        n=n,
        seeds=tuple(seeds),
        max_tokens=max_tokens,
        points=tuple(frontier_flags(points)),
        hardware=report.get("hardware", ""),
        commit=report.get("commit", ""),
    )
    return cal, report


def _points(report: dict, arms: list) -> list[Point]:
    """One Point per arm and task of a bench report."""
    by_label = {a.label: a for a in arms}
    points = []
    for row in report["arms"]:
        arm = by_label[row["arm"]]
        for task, t in row["per_task"].items():
            points.append(
                Point(
                    family=family_of(task),
                    task=task,
                    decoder=arm.decoder,
                    knobs=dict(arm.overrides),
                    n=t["n"],
                    accuracy=t["acc"],
                    tok_s=t["tok_s"],
                    fwd_per_req=t["fwd_req"] / max(t["n"], 1),
                    tau=t["tokens"] / max(t["fwd_req"], 1),
                    g_over_tau=t.get("rows", 0) / max(t["tokens"], 1),
                    reference=arm.decoder == "official" and not arm.overrides,
                )
            )
    return points


# -- reports ---------------------------------------------------------------------------------------
def table(cal: Calibration, budget: float, frontier_only: bool = False) -> str:
    """The frontier as a markdown table per family, with the route auto would take marked."""
    lines = [
        (
            f"{cal.describe()}: {cal.model_path} (fingerprint {cal.fingerprint[:12]}), {cal.hardware}, "
            f"commit {cal.commit or '?'}, max_tokens {cal.max_tokens}"
        ),
        "",
        (
            "| family | setting | n | acc | Δ vs official | tok/s | × official | fwd/req | τ | G/τ | vs capped line "
            "| frontier | auto |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in cal.families():
        ref = cal.reference(fam)
        pick = cal.choose(fam, budget)
        pts = sorted(cal.family_points(fam), key=lambda p: (p.decoder != "official", p.decoder, -p.tok_s))
        for p in pts:
            if frontier_only and not p.frontier and p is not pick and not p.reference:
                continue
            d_acc = f"{(p.accuracy - ref.accuracy) * 100:+.1f}" if ref else "?"
            speed = f"{p.tok_s / ref.tok_s:.2f}" if ref and ref.tok_s else "?"
            at = cal.official_line(fam, p.fwd_per_req) if p.decoder in ("pipe", "funnel") else None
            vs_line = f"{(p.accuracy - at) * 100:+.1f}" if at is not None else ""
            lines.append(
                f"| {fam} | {p.label}{' (reference)' if p.reference else ''} | {p.n} | {p.accuracy * 100:.1f} % | "
                f"{d_acc} | {p.tok_s:.0f} | {speed} | {p.fwd_per_req:.2f} | {p.tau:.2f} | {p.g_over_tau:.2f} | "
                f"{vs_line} | {'*' if p.frontier else ''} | {'<-' if p == pick else ''} |"
            )
    lines += [
        "",
        (
            f"auto: the fastest setting within {budget:g} points of the reference (CANVASQ_ROUTING_BUDGET; with "
            f"95 % confidence at this n) that does less work per token (τ or G/τ {WORK_MARGIN:.0%} better) and is "
            f"measured {MIN_GAIN:.0%} faster. "
            "vs capped line: a step decoder's accuracy minus the capped official sampler's at equal "
            "forwards per request (linear between its step caps; >= 0 is on or above the line)."
        ),
    ]
    return "\n".join(lines) + "\n"


def plot(cal: Calibration, path: Path) -> None:
    """Accuracy against committed tok/s, one line per decoder (its frontier), one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = cal.families()
    fig, axes = plt.subplots(1, len(fams), figsize=(5.5 * len(fams), 4.2), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        pts = cal.family_points(fam)
        for dec in sorted({p.decoder for p in pts}):
            mine = sorted((p for p in pts if p.decoder == dec), key=lambda p: p.tok_s)
            front = [p for p in mine if p.frontier]
            (line,) = ax.plot([p.tok_s for p in front], [p.accuracy * 100 for p in front], "-o", label=dec)
            rest = [p for p in mine if not p.frontier]
            ax.scatter(
                [p.tok_s for p in rest],
                [p.accuracy * 100 for p in rest],
                color=line.get_color(),
                alpha=0.4,
                marker="x",
            )
        ref = cal.reference(fam)
        if ref:
            ax.axhline(ref.accuracy * 100, color="grey", lw=0.8, ls="--")
        ax.set_title(fam)
        ax.set_xlabel(f"committed tok/s (batch {cal.batch_size}, {cal.device})")
        ax.set_ylabel("accuracy %")
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(cal.model_path).name} · n={cal.n} · seeds {list(cal.seeds)} · {cal.created_at}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
