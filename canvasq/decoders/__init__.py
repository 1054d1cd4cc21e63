"""Generation algorithms for DiffusionGemma: `official` (HF generate), `pipe` (D2F), `funnel`.

Flow: Job (core, CPU) → DecodeBatch (worker: several tokenised prompts) → `run_batch` → a strategy's
loop → windows (model: `Window`s, the rows of one forward) → DecodeResult per request, with one
ForwardTrace per model pass (G rows, τ commits, ms).

`run_batch` is the only entry point the service uses. `decoder="auto"` routes each request by its
task (`routing.route`), so one batch may be split into sub-batches, one per (decoder, knobs); the
results come back in request order. A failing request returns a result with `error` set.

Where each mechanism lives (config field in parentheses):
    base.py       the loop: slots (slots.py), prefill, per-row RNG, cancellation, per-row errors,
                  liveness budget, a canvas's retirement and commit encode, CUDA-graph forwards over
                  a persistent arena (cuda_graphs → model.graph.GraphRunner); traces.py the pass log
                  and its CUDA-event timer; state.py a row's state; windows.py a folded window
    official.py   the native sampler (HF generate()'s algorithm) as a strategy over the loop, its
                  per-request state batched by slot (sampling.py: SlotState, draws, acceptance,
                  stopping rule); hf.py HF generate() itself, traced from
                  outside (hf_trace.py)
    pipe.py       multi-canvas D2F scheduling (max_canvases), full/semi/draft, τ_add / τ_act, draft
                  spawn (draft_spawn, spawn_margin), τ_conf, argmax / mix renoise (renoise,
                  mix_fraction), Jacobi restart (jacobi_window, jacobi_max_commits), forced accept,
                  τ_eos + EOS streak, self-conditioning (self_conditioning, sc_topk), encoder pass
                  on retire, D2F adapter (adapter); the canvas pipeline's mechanics (window,
                  self-conditioning store, renoise, entropy cap, turnover) in canvases.py
    funnel.py     shrinking window (shrink), promote one step late, arena / simple promotion
                  (promote), free front retire (retire_refresh), prefix attention, τ_decay,
                  early spawn, commit-agree (agree), top-k self-conditioning (sc_topk=64)
    phcd.py       PHCD: global canvas of N windows (windows), coarse passes (coarse_every), native-
                  sampler fine steps on the local window, safe-prefix commits per task family
                  (math_commit / code_commit / text_commit, commit_scale), future kept across commits,
                  weights (adapter: D2F, base, or "repair", the repair-trained LoRA); its global
                  canvas, native-sampler pieces and commit sizes in phcd_plan.py
    routing.py    --decoder auto (settings table, then the model's calibration, then official)
    calibration.py  `canvasq calibrate`: dev-set sweep, frontier, SQL per model identity
    registry.py names;  configs.py typed configs with the defaults
    bench.py/cli.py  `canvasq bench` (same-process ABBA A/B) and `canvasq calibrate`
"""

from __future__ import annotations

from collections.abc import Callable

from canvasq.decoders.registry import NAMES, UnknownDecoder, make_decoder
from canvasq.decoders.types import (
    CANCELLED,
    DecodeBatch,
    DecodeRequest,
    DecodeResult,
    ForwardTrace,
    Interrupted,
)

__all__ = [
    "CANCELLED",
    "NAMES",
    "DecodeBatch",
    "DecodeRequest",
    "DecodeResult",
    "ForwardTrace",
    "Interrupted",
    "UnknownDecoder",
    "run_batch",
]


def run_batch(
    bundle,
    batch: DecodeBatch,
    decoder: str = "official",
    overrides: dict | None = None,
    should_stop: Callable[[], bool] | None = None,
    routing: dict[str, str] | None = None,
    interrupts: tuple[type[BaseException], ...] = (),
    cuda_graphs: str | None = None,
    experts: str | None = None,
    calibration=None,
    budget: float | None = None,
    fp8: str | None = None,
    fp8_min_rows: int | None = None,
) -> list[DecodeResult]:
    """Decode every request of `batch`; one DecodeResult per request, in order.

    decoder: "official" | "pipe" | "funnel" | "auto" (per-request routing by task; `routing` is the
      settings table task → decoder, `calibration` the model's `calibration.Calibration` and `budget`
      the accuracy points auto may give up against official: `routing.route`).
    overrides: config fields of the chosen decoder (unknown names raise ValueError before any work).
    should_stop: polled between forwards; when it turns true the unfinished rows come back with
      `error == finish_reason == "cancelled"`.
    interrupts: exception types that end the batch instead of erroring rows (the worker's soft time
      limit, which the decoders' per-step `except Exception` would otherwise swallow): one of them
      raises `Interrupted` from it, holding the rows that had finished.
    cuda_graphs: "auto" / "off" for the step decoders (the service's `cuda_graphs` setting); None
      keeps their config default, and `overrides` win over it.
    experts: "bf16" / "w4" for every decoder (the service's resolved `experts` setting); None keeps
      the config default, and `overrides` win over it.
    fp8, fp8_min_rows: the FP8 path for large forwards (CANVASQ_FP8, CANVASQ_FP8_MIN_ROWS), the same way.
    """
    if decoder != "auto":
        dec = make_decoder(
            decoder, bundle, overrides, cuda_graphs, experts=experts, fp8=fp8, fp8_min_rows=fp8_min_rows
        )
        return dec.decode(batch, should_stop=should_stop, interrupts=interrupts)

    from canvasq.decoders.routing import group_by_route

    groups = group_by_route([r.task for r in batch.requests], routing, calibration, budget, overrides)
    results: list[DecodeResult | None] = [None] * len(batch.requests)
    for name, knobs, idx in groups:
        dec = make_decoder(
            name, bundle, knobs, cuda_graphs, experts=experts, fp8=fp8, fp8_min_rows=fp8_min_rows
        )
        sub = DecodeBatch(requests=[batch.requests[i] for i in idx], seed=batch.seed)
        try:
            out = dec.decode(sub, should_stop=should_stop, interrupts=interrupts)
        except Interrupted as cut:  # rows of the sub-batches decoded before it finished too
            earlier = [res for res in results if res is not None and not res.error]
            raise Interrupted(cut.cause, earlier + cut.done) from cut.cause
        for i, res in zip(idx, out):
            results[i] = res
    return results  # type: ignore[return-value]
