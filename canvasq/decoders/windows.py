"""A canvas's decoder window as the loop builds it, with an encoder pass folded in front when encoder
passes ride in the decoder forward (`fold_encode`, `StepDecoder.take_deferred`)."""

from __future__ import annotations

import torch

from canvasq.model.windows import SelfCond, Window


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
