"""A revisable front canvas: pipe's and Funnel's `front="revise"` (issue 35, item 1).

Under D2F's rule (`front="commit"`, the default) a front position whose p(argmax) clears τ_conf is
committed and never changes, and a step in which none clears it force-commits the most confident
one. Under `front="revise"` the front canvas finishes the way the native sampler finishes a canvas:

- every position of the front is re-decided on every step (nothing is final; the open positions ride
  as their argmax, pipe's renoising), and the canvas is **accepted whole** on the first step on which
  every position clears τ_conf (`commit_threshold`, so Funnel's τ decay counts) with its argmax
  unchanged from the step before (the input it rode with: a fixed point of the denoiser, the analogue
  of the native sampler's stability test);
- a step on which it is not accepted is a wait, not a forced commit; after `front_wait` steps as the
  front its argmax is accepted as it is (a bounded wait, the analogue of the native step cap);
- the canvases behind the front stay drafts (`draft_only` is required): pipelining only warms the
  next canvas, whose draft and self-conditioning the next front starts from. The next draft spawns
  when the share of the front's positions that cleared τ_conf on its last step (`Canvas.settled`)
  reaches the spawn threshold, as a committing front's decode fraction does.

The front is the first canvas of a sequence with an open position, decided as the step's canvases
are updated in order: the canvas behind one accepted on this step is the front for this step's logits
already (they saw the accepted canvas's input, its final tokens when the rule accepted it), and with
Funnel, whose accepted canvas rides one more step to promote its rows, for that step too. An accepted canvas's commits are ordinary commits from then on (the
pipe's retire pass, Funnel's promotion and free retire).

Counters (`DecodeResult.stats`): `front_accepts` (canvases accepted by the rule), `front_timeouts`
(accepted at the bound), `revised` (positions that cleared τ_conf on one step, and so would have been
final under D2F's rule, and changed their argmax on the next).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from canvasq.decoders.state import Canvas, Seq

if TYPE_CHECKING:
    from canvasq.decoders.canvases import CanvasOut
    from canvasq.decoders.pipe import PipeDecoder


def revising(dec: PipeDecoder, s: Seq, cv: Canvas) -> bool:
    """Whether `cv` is a revising front: `front="revise"`, every canvas before it fully committed and
    `cv` not (Funnel's accepted canvas rides one more step, to promote)."""
    if dec.config.front != "revise":
        return False
    for c in s.canvases:
        if not bool(c.committed.all()):
            return c is cv
    return False


def accept(dec: PipeDecoder, s: Seq, co: CanvasOut, open_: torch.Tensor) -> torch.Tensor:
    """The revising front's step: every open row (the whole canvas) when the canvas is accepted —
    every open row at p(argmax) ≥ the threshold and its argmax equal to the input it rode with, or
    the front has waited `front_wait` steps — else none."""
    cv, idx = co.part.cv, co.part.idx
    cv.state = "full"
    cv.front_steps += 1
    sure = co.conf >= dec.commit_threshold(cv)
    stable = co.arg == cv.tokens[idx]
    if cv.sure is not None:  # cleared τ on the last step (final under D2F's rule), changed now
        s.stats["revised"] += int((cv.sure[idx] & ~stable & open_).sum())
    else:
        cv.sure = torch.zeros(cv.length, dtype=torch.bool, device=cv.tokens.device)
    cv.sure[idx] = sure
    cv.settled = float(cv.sure.float().mean())
    if bool((sure & stable)[open_].all()):
        s.stats["front_accepts"] += 1
        return open_.clone()
    if cv.front_steps >= dec.config.front_wait:
        s.stats["front_timeouts"] += 1
        return open_.clone()
    return torch.zeros_like(open_)


def extra_steps(dec: PipeDecoder, seqs: list[Seq]) -> int:
    """What the liveness guard allows beyond a committing front's C steps per canvas: a revising
    front may wait `front_wait` steps per canvas instead."""
    if dec.config.front != "revise":
        return 0
    return max(s.n_canvases for s in seqs) * dec.config.front_wait
