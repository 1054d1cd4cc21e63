"""A canvas's decoder window as the loop builds it, with an encoder pass folded in front when encoder
passes ride in the decoder forward (`fold_encode`, `StepDecoder.take_deferred`); a step's front canvases'
windows at once (`front_windows`, `canvas_windows`)."""

from __future__ import annotations

import torch

from canvasq.decoders.state import Canvas, Seq
from canvasq.model.windows import SelfCond, Window, to_device


def canvas_window(
    slot: int,
    tokens: torch.Tensor,
    start: int,
    self_cond: SelfCond = None,
    self_cond_rows: torch.Tensor | None = None,
    enc: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Window:
    """One canvas (`tokens` [C] at positions start..start+C, bidirectional) with its self-conditioning.
    `enc` (ids, positions): an encoder pass of the slot's (a prompt, retired canvases) in front, as
    causal rows with no self-conditioning; the canvas's rows see them and the cache."""
    if enc is None:
        return Window.canvas(slot, tokens, start, self_cond=self_cond, self_cond_rows=self_cond_rows)
    ids, pos = enc
    n, C, dev = ids.numel(), tokens.numel(), tokens.device
    sc, rows = self_cond, self_cond_rows
    if sc is not None:
        on = torch.ones(C, dtype=torch.bool, device=dev) if rows is None else rows
        rows = torch.cat([torch.zeros(n, dtype=torch.bool, device=dev), on])

        def behind(t: torch.Tensor) -> torch.Tensor:  # no signal for the encoder rows in front
            return torch.cat([t.new_zeros((n, *t.shape[1:])), t])

        sc = (behind(sc[0]), behind(sc[1])) if isinstance(sc, tuple) else behind(sc)
    canvas = torch.arange(start, start + C, device=dev)
    return Window(
        slot,
        torch.cat([ids, tokens]),
        torch.cat([pos, canvas]),
        torch.cat([pos, torch.full_like(canvas, start)]),
        torch.cat([pos + 1, torch.full_like(canvas, start + C)]),
        self_cond=sc,
        self_cond_rows=rows,
        encoder_rows=n,
    )


def canvas_windows(
    items: list[tuple[int, torch.Tensor, int, SelfCond, torch.Tensor | None]], device: torch.device
) -> list[Window]:
    """`canvas_window` (without an encoder pass) for each (slot, tokens [C], start, self_cond,
    self_cond_rows) of a step: every window's positions and canvas bounds are views of one [n, C]
    tensor each, built with a few launches for the step (`Window.canvas` takes three a window: 192
    of a 64-slot step's few hundred on a GPU whose testbed step is bound by its launches)."""
    if not items:
        return []
    C = items[0][1].numel()
    if any(t.numel() != C for _, t, *_ in items):
        return [canvas_window(slot, t, start, sc, rows) for slot, t, start, sc, rows in items]
    first = to_device([start for _, _, start, *_ in items], device)
    pos = first[:, None] + torch.arange(C, device=device)
    lo, hi = first[:, None].expand(-1, C), (first + C)[:, None].expand(-1, C)
    return [
        Window(slot, t, pos[b], lo[b], hi[b], self_cond=sc, self_cond_rows=rows)
        for b, (slot, t, _, sc, rows) in enumerate(items)
    ]


def window_sc(cv: Canvas, zero_sc: tuple | None) -> tuple[SelfCond, torch.Tensor | None]:
    """A canvas's window's (self_cond, self_cond_rows). A canvas's first step has no self-conditioning;
    with top-k SC (`zero_sc`: the zero signal and its rows, all off) it still carries a zero top-k
    signal (exactly HF's "no logits"), so every window of a forward has the same kind and graphed
    forwards share one capture."""
    return (cv.sc, None) if cv.sc is not None or zero_sc is None else zero_sc


def front_windows(seqs: list[Seq], zero_sc: tuple | None, device: torch.device, enc: dict) -> list[Window]:
    """Each row's front canvas's decoder window, with `enc[row]` (an encoder pass) in front where
    given; without any, built together (`canvas_windows`)."""
    items = [
        (s.slot, s.canvases[0].tokens, s.canvases[0].start, *window_sc(s.canvases[0], zero_sc)) for s in seqs
    ]
    if not enc:
        return canvas_windows(items, device)
    return [canvas_window(*item, enc.get(s.row)) for s, item in zip(seqs, items)]
