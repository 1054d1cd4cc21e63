"""One typed config per decoder strategy, with each strategy's default knobs.

`with_overrides(cfg, {...})` is the only way a request or a routing rule changes a knob: unknown
keys fail loudly instead of being ignored, and values are checked in `__post_init__`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

EXPERTS = ("bf16", "w4")
RENOISE = ("argmax", "mix")
PROMOTE = ("arena", "simple")
FRONT = ("commit", "revise", "native")
GRAPHS = ("auto", "on", "off")

# Row counts below (early_spawn_rows, commit_window) are the seeds' values for DiffusionGemma's
# 256-token canvases; a decoder scales them to its model's canvas length with `canvas_rows`, so the
# same setting means the same share of a canvas on the testbed (32) as on the real checkpoint (256).
# τ_add / τ_act are decode fractions and need no scaling.
SEED_CANVAS = 256
# Forwards from this many rows use the FP8 path where it is on (CANVASQ_FP8_MIN_ROWS): below it a
# forward is bandwidth-bound and the W4 experts read fewer bytes
FP8_MIN_ROWS = 1024
FP8_PARTS = ("experts", "dense", "head")  # model/fp8.py's PARTS (named here without importing torch)
DRAWS = ("gumbel", "invcdf")  # kernels/softmax_invcdf.py's DRAWS (named here without importing triton)


def canvas_rows(rows: int, canvas_length: int) -> int:
    """`rows` given for a 256-token canvas, on a canvas of `canvas_length` (at least 1)."""
    return max(1, round(rows * canvas_length / SEED_CANVAS))


@dataclass(frozen=True)
class HfConfig:
    """`hf`: HF `generate()` unchanged (the reference arm). `None` keeps the checkpoint's generation
    config."""

    experts: str = "bf16"  # "w4": the W4A16 A/B arm (Triton W4A16 experts swapped in)
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None

    def __post_init__(self):
        _check_choice("experts", self.experts, EXPERTS)


@dataclass(frozen=True)
class OfficialConfig:
    """`official`: the native sampler's algorithm on canvasq's runtime. Every sampler knob left at
    `None` is resolved exactly as `generate()` resolves it (the checkpoint's generation config, then
    HF's defaults: 48 steps, entropy bound 0.1, temperature 0.8 -> 0.4, stop when the argmax is
    stable for 1 step and the mean entropy is under 0.005)."""

    experts: str = "bf16"
    fp8: str = "auto"  # FP8 GEMMs in forwards of >= fp8_min_rows rows (model/fp8.py): auto | off | parts
    fp8_min_rows: int = FP8_MIN_ROWS
    max_denoising_steps: int | None = None  # the step cap per canvas (also sets the temperature ramp)
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    # Self-conditioning from the top-k of the previous step's logits (None: the full vocabulary, as
    # generate() does; at the real vocabulary that is a [rows, 262,144] projection per step)
    sc_topk: int | None = 64
    # "row": each request draws from its own generator (seed + custom_id: batch-invariant output);
    # "plain": seeded with the batch seed alone, which at batch 1 draws exactly what
    # `torch.manual_seed(seed)` then `generate()` draws (the parity test)
    seed_mode: str = "row"
    # The draws: "torch" = per request, torch.multinomial + randint on the request's generator (HF's
    # ops and order); "fused" = one kernel for the whole batch (Gumbel-max from softmax, Philox keyed
    # by request, canvas and step: the same distribution, other draws); "auto" = fused on CUDA with
    # seed_mode "row", torch otherwise
    sampler: str = "auto"
    # A finished canvas's encoder pass waits for the next pass that encodes new prompts (one encoder
    # pass per step instead of two); the row's next decoder step still sees it. False: at once
    defer_commits: bool = True
    # Each step's windows in arena-slot order: with every slot live the forward then reads the arena as
    # one slice instead of gathering every layer's K/V per window (the gathers cost about 100 ms of a
    # 64 x 256-row step on an H200, BENCHMARKS.md "Service throughput"). False: admission order
    slot_order: bool = True
    # Encoder passes ride in the next decoder forward: a row's retired canvas or its prompt goes in
    # front of its canvas window as causal rows (the stacks share their weights; the rows keep the
    # encoder's layer scalars and skip the decoder's input norm), as query blocks of their own of at
    # most a canvas's rows, so a step runs one forward instead of two. Off: the riders' rows then pay
    # the decoder step's cost in every layer, which ate the saved passes (BENCHMARKS.md "Service
    # throughput": a tie at 64 slots on an H200)
    fold_encode: bool = False
    # With the fused sampler, top-k self-conditioning and a deferred LM head, the sampler's reads apply
    # the final soft cap to the head's bf16 output (no fp32 [rows, V] copy written and read twice).
    # Off: with the Gumbel draw the reads are compute-bound and a tanh each costs what the skipped pass
    # saves (an H200 A/B measured no gain, BENCHMARKS.md "Service throughput"), and over the
    # inverse-CDF draw it costs more than it saves (10,686 against 11,475 tok/s). False: the head writes
    # capped fp32 logits first, as HF does
    cap_on_read: bool = False
    # The fused sampler's draw: "gumbel" (Gumbel-max in the statistics read: a uniform and two logs per
    # logit) or "invcdf" (inverse CDF over the sums that read keeps, one uniform per row and one lane's
    # logits read again: kernels/softmax_invcdf.py). The same distribution, other draws. "invcdf" is the
    # default: without the logs per logit its pass is memory-bound, which on the H200 gave +6.1 %
    # committed tok/s through the worker loop at the testbed's accuracy (84.1 % against Gumbel's 83.7 %
    # and HF generate()'s 84.5 %; BENCHMARKS.md "Service throughput")
    draw: str = "invcdf"
    # Structured output (decoders/constrained.py): a constrained canvas whose best valid path has not
    # changed for this many steps is pinned to it (its logits one-hot) and ends in that step (as does any
    # canvas pinned at every position), without waiting for a confidence the model may never reach on
    # the schema's values. None: off
    constraint_settle: int | None = 2
    # Before the whole path holds, the document's positions whose tokens on it have held this many
    # steps are pinned from its start up to the first that has not: a schema's uncertain values (an
    # array's length, an enum) otherwise keep a canvas to the step cap. 1 was chosen on dev prompts
    # (0 lost the answer; BENCHMARKS.md "A settled document prefix pinned"). None: off
    constraint_settle_positions: int | None = 1
    # A canvas with part of the document on its best valid path is pinned to that path at its
    # max_steps-th step, settled or not: a value the model stays unsure of (an array's last element)
    # otherwise holds the canvas, and with it the stream's tail, one step at a time. Given for a
    # 256-token canvas and scaled to the model's (`canvas_rows`): 48, HF's own step cap there, is 6 steps
    # on the testbed's 32, where the H100 ran `answer_totals` at -2.8 % of the free rows' tok/s against
    # -15.7 % uncapped (201 stream steps against 245; BENCHMARKS.md "A step cap for document canvases
    # again"). None: off
    constraint_max_steps: int | None = 48
    # Thinking first: where the model's argmax has opened the document (its first "{" or "[") at the
    # same position for this many steps while the best valid path is still all thought, that token is
    # pinned there, so the path begins the document where the model does. None: off
    constraint_open_hold: int | None = 1
    # A peft LoRA directory merged into the model for every pass (decoders/adapters.py), e.g. the
    # certainty adapter `canvasq adapt --decoder official` trains. None: the checkpoint's own weights
    adapter_path: str | None = None
    cuda_graphs: str = "auto"

    def __post_init__(self):
        _check_choice("experts", self.experts, EXPERTS)
        _check_fp8(self.fp8, self.fp8_min_rows)
        _check_choice("cuda_graphs", self.cuda_graphs, GRAPHS)
        _check_choice("seed_mode", self.seed_mode, ("row", "plain"))
        _check_choice("sampler", self.sampler, ("auto", "torch", "fused"))
        _check_choice("draw", self.draw, DRAWS)
        if self.max_denoising_steps is not None and self.max_denoising_steps < 1:
            raise ValueError(f"max_denoising_steps must be ≥ 1 or None, got {self.max_denoising_steps}")
        if self.entropy_bound is not None and self.entropy_bound <= 0:
            raise ValueError(f"entropy_bound must be > 0 or None, got {self.entropy_bound}")
        if self.sc_topk is not None and self.sc_topk < 1:
            raise ValueError(f"sc_topk must be ≥ 1 or None, got {self.sc_topk}")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be ≥ 0 or None, got {self.stability_threshold}")
        _check_adapter_path(self.adapter_path)
        if self.constraint_max_steps is not None and self.constraint_max_steps < 1:
            raise ValueError(f"constraint_max_steps must be ≥ 1 or None, got {self.constraint_max_steps}")
        for name in ("constraint_settle", "constraint_settle_positions", "constraint_open_hold"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0 or None, got {getattr(self, name)}")


@dataclass(frozen=True)
class PipeConfig:
    """D2F pipe: K canvases in flight, block-causal, states full / semi / draft."""

    max_canvases: int = 2  # K
    tau_conf: float = 0.9  # commit when p(argmax) ≥ τ_conf (routing: 0.7 maths, 0.85 code)
    tau_add: float = 0.5  # previous canvas's decode fraction at which a draft becomes semi
    tau_act: float = 0.95  # ... at which it becomes full
    draft_spawn: bool = True  # spawn the next canvas as a draft at τ_add − spawn_margin
    spawn_margin: float = 0.15
    renoise: str = "argmax"  # "argmax" (the record protocol) or "mix"
    mix_fraction: float = 0.1  # mix mode: share of uncommitted positions redrawn uniformly
    jacobi_window: int = 8  # Jacobi restart after this many steps ...
    jacobi_max_commits: int = 1  # ... of at most this many commits on a canvas
    forced_accept: bool = True  # the front full canvas commits ≥ 1 token per step
    tau_eos: float | None = None  # EOS priority: a lower bar for argmax-EOS (code: 0.5)
    # Entropy budget (the official sampler's rule, applied on top of τ_conf): of the positions that
    # clear τ_conf, commit the lowest-entropy ones while Σ entropy − max ≤ budget (nats). Guards
    # against committing several individually confident but jointly inconsistent tokens at once.
    entropy_budget: float | None = None
    # Left-first commits: only the first `commit_window` still-open positions of a canvas may commit
    # in a step (None: any position); rows of a 256-token canvas, scaled (`canvas_rows`). Worked arithmetic is left-to-right dependent: a result digit
    # committed before its operands settle cannot be revised (commits are final).
    commit_window: int | None = None
    eos_streak: bool = False  # EOS priority needs two consecutive argmax-EOS decisions
    # Draft-only pipelining: canvases behind the front stay drafts (renoised, self-conditioned, never
    # committing) until they become the front, so nothing is committed against a half-settled
    # predecessor; off, they graduate to semi at τ_add and full at τ_act as in the seed (whose
    # 256-token canvases an answer rarely crosses; the testbed's 32-token ones it crosses 3-4 times).
    draft_only: bool = True
    # The front canvas's commits (issue 35): "commit" (D2F's: a position that clears τ_conf is final,
    # forced accept on a stalled front); "revise" (the native sampler's way: every position of the front
    # is re-decided each step and the canvas is accepted whole once every position clears τ_conf with
    # its argmax unchanged from the step before, or after `front_wait` steps as the front; the canvases
    # behind stay drafts, so pipelining only warms the next canvas); "native" (the front canvas runs
    # official's own sampler: draws, renoise, HF's stopping rule; the drafts behind warm the next
    # front's start). decoders/front.py
    front: str = "commit"
    front_wait: int = 16  # "revise": steps as the front after which its argmax is accepted as it is
    self_conditioning: bool = True
    sc_topk: int | None = None  # top-k self-conditioning projection; None = full vocabulary
    adapter: bool = True  # decode with the D2F LoRA merged (`bundle.d2f_model()`)
    # Another peft LoRA directory merged in place of `<model>/d2f_adapter/` (absolute, relative to the
    # working directory or to the model directory), e.g. one `canvasq adapt` trained; None: the model's
    # own. decoders/adapters.py
    adapter_path: str | None = None
    # The merged LoRA in the encoder passes too (prompt, committed canvases). HF ties the encoder's
    # weights to the decoder's, so a merge reaches both, though the adapter was trained to denoise
    # decoder passes. False (default): the encoder runs the base weights, at the cost of one more
    # copy of the fused attention and dense MLP weights (the experts stay shared). Testbed, 200 × 2
    # tasks × 3 seeds: pipe 65.6 -> 73.5 %, Funnel 54.8 -> 61.8 %, each with fewer forwards
    # (BENCHMARKS.md, "Testbed accuracy per decoder").
    adapter_encoder: bool = False
    experts: str = "bf16"
    fp8: str = "auto"  # FP8 GEMMs in forwards of >= fp8_min_rows rows (model/fp8.py): auto | off | parts
    fp8_min_rows: int = FP8_MIN_ROWS
    # Decoder forwards replayed as CUDA graphs over a persistent arena (`model.graph.GraphRunner`):
    # "auto" on a CUDA device, "off" eager, "on" the same prepared forwards on any device (CPU tests)
    cuda_graphs: str = "auto"

    def __post_init__(self):
        _check_choice("experts", self.experts, EXPERTS)
        _check_fp8(self.fp8, self.fp8_min_rows)
        _check_choice("renoise", self.renoise, RENOISE)
        _check_choice("cuda_graphs", self.cuda_graphs, GRAPHS)
        if not 1 <= self.max_canvases <= 8:
            raise ValueError(f"max_canvases must be in 1..8, got {self.max_canvases}")
        for name in ("tau_conf", "tau_add", "tau_act"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.commit_window is not None and self.commit_window < 1:
            raise ValueError(f"commit_window must be ≥ 1 or None, got {self.commit_window}")
        if self.entropy_budget is not None and self.entropy_budget < 0:
            raise ValueError(f"entropy_budget must be ≥ 0 or None, got {self.entropy_budget}")
        if self.tau_eos is not None and not 0.0 < self.tau_eos <= 1.0:
            raise ValueError(f"tau_eos must be in (0, 1] or None, got {self.tau_eos}")
        if self.sc_topk is not None and self.sc_topk < 1:
            raise ValueError(f"sc_topk must be ≥ 1 or None, got {self.sc_topk}")
        if self.jacobi_window < 1:
            raise ValueError("jacobi_window must be ≥ 1")
        _check_choice("front", self.front, FRONT)
        if self.front_wait < 1:
            raise ValueError(f"front_wait must be ≥ 1, got {self.front_wait}")
        _check_adapter_path(self.adapter_path)
        if self.front != "commit" and not self.draft_only:
            raise ValueError(
                f"front={self.front!r} needs draft_only=True: a canvas behind the front never commits"
            )

    @property
    def spawn_threshold(self) -> float:
        """Previous canvas's decode fraction at which the next canvas may start."""
        return self.tau_add - self.spawn_margin if self.draft_spawn else self.tau_add


@dataclass(frozen=True)
class FunnelConfig(PipeConfig):
    """Pipe's state machine plus the shrinking window and the scattered KV cache."""

    tau_conf: float = 0.7
    sc_topk: int | None = 64
    shrink: bool = True  # committed rows leave the window (off: every canvas row rides every step)
    promote: str = "arena"  # "arena" (preallocated, in place) or "simple" (concatenate)
    retire_refresh: bool = False  # re-encode a finished canvas on retire (pipe parity)
    prefix_attention: bool = True  # per-segment mask-free attention where the band is a no-op
    tau_decay: bool = False  # lower τ_conf on a canvas live for more than decay_after forwards
    decay_after: int = 16
    decay_rate: float = 0.02  # per forward beyond decay_after
    decay_floor: float = 0.45
    early_spawn: bool = False  # spawn at once when the joint window is ≤ early_spawn_rows
    early_spawn_rows: int = 48  # rows of a 256-token canvas, scaled (`canvas_rows`)
    agree: bool = False  # commit only when the argmax also equals the previous step's draft

    def __post_init__(self):
        super().__post_init__()
        _check_choice("promote", self.promote, PROMOTE)
        if not 1 <= self.max_canvases <= 5:
            raise ValueError(f"funnel max_canvases must be in 1..5, got {self.max_canvases}")
        if self.early_spawn_rows < 0:
            raise ValueError(f"early_spawn_rows must be ≥ 0, got {self.early_spawn_rows}")


@dataclass(frozen=True)
class PhcdConfig:
    """PHCD: a global canvas of `windows` local windows, coarse passes over it, fine steps on the
    local window, safe-prefix commits, future repair (decoders/phcd.py)."""

    windows: int = 4  # N: the global canvas holds N windows of the model's canvas length
    coarse_every: int = 4  # the future rides the first forward and every this many after it
    # (min, max) tokens per commit by task family, given for 256-token canvases (maths 4-16, code
    # 8-32, text 32-128) and scaled to the model's canvas (`canvas_rows`)
    math_commit: tuple[int, int] = (4, 16)
    code_commit: tuple[int, int] = (8, 32)
    text_commit: tuple[int, int] = (32, 128)
    commit_scale: int = 1  # every size × this: the ranges are starting points, the frontier asks how large
    safe_entropy: float = 0.1  # nats: a position is safe when its argmax repeats under this entropy
    max_fine_steps: int = 8  # fine steps without a commit before the minimum is committed anyway
    promote: str = "late"  # committed K/V: "late" (promoted from the next forward) or "encode"
    entropy_bound: float | None = None  # the fine sampler's acceptance bound (None: the checkpoint's)
    sc_topk: int = 64
    # the D2F LoRA (`bundle.d2f_model()`): the future's block-causal layout is the one it was trained
    # on; with base weights the drafted plan misleads the window (testbed arith 81 → 38 %, n = 16).
    # "repair": the D2F model with the repair-trained LoRA (`<dir>/phcd_adapter/`, testbed/repair.py)
    # merged on top (`bundle.phcd_repair_model()`)
    adapter: bool | str = True
    experts: str = "bf16"
    cuda_graphs: str = "auto"

    def __post_init__(self):
        _check_choice("experts", self.experts, EXPERTS)
        _check_choice("cuda_graphs", self.cuda_graphs, GRAPHS)
        _check_choice("promote", self.promote, ("late", "encode"))
        if self.adapter not in (True, False, "repair"):
            raise ValueError(f"adapter must be true, false or 'repair', got {self.adapter!r}")
        for name in ("math_commit", "code_commit", "text_commit"):
            v = tuple(getattr(self, name))
            if len(v) != 2 or not 1 <= v[0] <= v[1]:
                raise ValueError(f"{name} must be (min, max) with 1 ≤ min ≤ max, got {v}")
            object.__setattr__(self, name, v)  # JSON overrides arrive as lists
        if not 1 <= self.windows <= 64:
            raise ValueError(f"windows must be in 1..64, got {self.windows}")
        if min(self.coarse_every, self.max_fine_steps, self.sc_topk, self.commit_scale) < 1:
            raise ValueError("coarse_every, max_fine_steps, sc_topk and commit_scale must be ≥ 1")
        if self.safe_entropy <= 0:
            raise ValueError(f"safe_entropy must be > 0, got {self.safe_entropy}")


CONFIGS: dict[str, type] = {
    "official": OfficialConfig,
    "hf": HfConfig,
    "pipe": PipeConfig,
    "funnel": FunnelConfig,
    "phcd": PhcdConfig,
}


def with_overrides(cfg, overrides: dict[str, Any] | None):
    """A copy of `cfg` with `overrides` applied; an unknown key raises `ValueError`."""
    if not overrides:
        return cfg
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} option(s) {unknown}; known: {sorted(names)}")
    return dataclasses.replace(cfg, **overrides)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_fp8(value: str, min_rows: int) -> None:
    from canvasq.model.fp8 import parse_parts

    parse_parts(value, "cpu")  # raises with the setting's name on a bad list
    if not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(f"fp8_min_rows={min_rows!r}: expected a whole number >= 0")


def knobs_label(decoder: str, knobs: dict) -> str:
    """`funnel:draft_only=true,tau_conf=0.9` (the `--arm` syntax of bench and calibrate)."""
    import json

    if not knobs:
        return decoder
    return decoder + ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(knobs.items()))


def _check_adapter_path(path) -> None:
    if path is not None and not (isinstance(path, str) and path):
        raise ValueError(f"adapter_path must be a directory name or None, got {path!r}")
