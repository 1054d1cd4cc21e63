"""A revisable front canvas: pipe's and Funnel's `front="revise"` and `front="native"` (issue 35).

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

Under `front="native"` the front canvas is decoded by official's own sampler (`_native`: draws at the
temperature of its step, uniform noise outside the entropy bound, HF's stopping rule or the N-step
cap) on the adapter's logits, and the drafts behind warm the next front's start. Measured on the dev
split (BENCHMARKS.md): no fewer forwards than official's, so it is not a default.

Counters (`DecodeResult.stats`): `front_accepts` (canvases accepted by the rule), `front_timeouts`
(accepted at the bound), `revised` (positions that cleared τ_conf on one step, and so would have been
final under D2F's rule, and changed their argmax on the next).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch

from canvasq.decoders.configs import OfficialConfig
from canvasq.decoders.sampling import (
    SamplerSettings,
    draw_torch,
    entropy_bound_keep,
    stable_and_confident,
    temperatures,
)
from canvasq.decoders.state import Canvas, Seq

_SETTINGS: WeakKeyDictionary = WeakKeyDictionary()  # a model -> its native sampler's settings

if TYPE_CHECKING:
    from canvasq.decoders.canvases import CanvasOut
    from canvasq.decoders.pipe import PipeDecoder


def revising(dec: PipeDecoder, s: Seq, cv: Canvas) -> bool:
    """Whether `cv` is a revising front: `front="revise"` or `"native"`, every canvas before it fully
    committed and `cv` not (Funnel's accepted canvas rides one more step, to promote)."""
    if dec.config.front not in ("revise", "native"):
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
    if dec.config.front == "native":
        return _native(dec, s, co, open_)
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


def _native(dec: PipeDecoder, s: Seq, co: CanvasOut, open_: torch.Tensor) -> torch.Tensor:
    """`front="native"`: one step of the native sampler (`decoders.sampling`, official's pieces) on
    the front canvas, drawn from the request's generator: temperature by the front's step, a draw at
    the entropy-bounded positions and uniform noise elsewhere as its next input, and HF's stopping rule
    (argmax stable over the last S steps and mean entropy under the bound) or the N-step cap, which
    accepts the argmax whole. A draft that becomes the front starts from its warm argmax, not x_T."""
    cv, idx, smp = co.part.cv, co.part.idx, sampler(dec)
    left = torch.tensor([smp.steps - cv.front_steps + 1], dtype=torch.int32)
    temp = temperatures(left, smp)
    logits = co.logits[None] if temp is None else co.logits[None] / float(temp[0])
    argmax, entropy, _ = draw_torch(logits, [])
    keep = entropy_bound_keep(entropy, smp.entropy_bound)[0]
    probs = torch.softmax(logits[0].float(), dim=-1).to(s.gen.device)
    draw = torch.multinomial(probs, 1, generator=s.gen).squeeze(-1).to(cv.tokens.device)
    noise = torch.randint(0, probs.shape[-1], (idx.numel(),), generator=s.gen, device=s.gen.device)
    stopped = torch.zeros(1, dtype=torch.bool)
    if smp.stability_threshold is not None and smp.confidence_threshold is not None:
        if cv.history is None:
            cv.history = torch.full((1, smp.stability_threshold, cv.length), -1, device=cv.tokens.device)
        stopped, cv.history = stable_and_confident(cv.history, argmax, entropy, smp.confidence_threshold)
    cv.settled = float((co.conf >= dec.commit_threshold(cv)).float().mean())
    if bool(stopped[0]) or int(left[0]) <= 1:
        s.stats["front_accepts" if bool(stopped[0]) else "front_timeouts"] += 1
        return open_.clone()  # the commit writes this step's argmax (`co.arg`)
    cv.tokens[idx] = torch.where(keep, draw, noise.to(cv.tokens.device))
    return torch.zeros_like(open_)


def sampler(dec: PipeDecoder) -> SamplerSettings:
    """The native sampler's settings for the decoder's model (official's defaults: the checkpoint's
    generation config), resolved once."""
    if dec.model not in _SETTINGS:
        _SETTINGS[dec.model] = SamplerSettings.resolve(dec.model, OfficialConfig())
    return _SETTINGS[dec.model]


def extra_steps(dec: PipeDecoder, seqs: list[Seq]) -> int:
    """What the liveness guard allows beyond a committing front's C steps per canvas: a revising
    front may wait `front_wait` steps per canvas instead, a native one the sampler's N steps."""
    if dec.config.front not in ("revise", "native"):
        return 0
    wait = sampler(dec).steps if dec.config.front == "native" else dec.config.front_wait
    return max(s.n_canvases for s in seqs) * wait
