"""The host side of a forward: where each window's rows go in the arena, the attention geometry, the
self-conditioning entries, captured and folded-encoder rows, as device tensors and host ints
(`Prepared`). `Runtime._run` then launches only device work on them, so a CUDA graph can replay it
with the tensors overwritten (`model.graph.DecodeGraph`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from canvasq.model.arena import Captured, KVArena
from canvasq.model.attention_geometry import AttentionGeometry
from canvasq.model.windows import Window, to_device

if TYPE_CHECKING:
    from canvasq.model.runtime import Runtime


@dataclass
class Prepared:
    """Everything `Runtime._run` reads, built by `prepare` (device tensors, host ints)."""

    encoder: bool
    windows: list[Window]
    offsets: list[int]
    ids: torch.Tensor  # [N]
    pos: torch.Tensor  # [N]
    row_slot: torch.Tensor  # [N] arena slot of each row
    row_col: torch.Tensor  # [N] scratch entry of each row
    ctx: AttentionGeometry
    sc: list
    capture: torch.Tensor | None  # [n_cap] row indices, window order
    cap_owner: list[tuple[int, int]]  # (window, count) per window with captures
    arena: KVArena
    cos_sin: dict = field(default_factory=dict)  # filled by _run
    cap_slot: torch.Tensor | None = None  # [n_cap] arena slot / entry of each captured row
    cap_col: torch.Tensor | None = None
    static: bool = False  # replayed as a CUDA graph: no host sync, masks always applied
    prefix_attention: bool | None = None  # per-forward override of Runtime.prefix_attention
    logits_out: torch.Tensor | None = None  # fp32 buffer the logits are written into (DecodeGraph)
    enc_rows: torch.Tensor | None = None  # [N] bool: encoder rows riding in a decoder forward
    dec_rows: torch.Tensor | None = None  # [N_dec] the other rows' indices (the LM head's rows)
    dec_offsets: list[int] = field(default_factory=list)  # window i's logits: dec_offsets[i]:[i + 1]
    defer_head: bool = False  # `_run` stops at the final-normed hidden state (`DecodeOutput.head`)

    def split_captured(self, cap_k, cap_v) -> list[Captured | None]:
        """Per window, the K/V its `capture` rows wrote in this forward (None: it captured none)."""
        out: list[Captured | None] = [None] * len(self.windows)
        if self.capture is None:  # no window captures (cap_owner is empty)
            return out
        start = 0
        for b, count in self.cap_owner:
            sl = slice(start, start + count)
            out[b] = Captured([k[sl] for k in cap_k], [v[sl] for v in cap_v], self.pos[self.capture[sl]])
            start += count
        return out


def prepare(
    rt: Runtime,
    arena: KVArena,
    windows: list[Window],
    encoder: bool,
    lmax: int | None = None,
    capture: bool = True,
) -> Prepared:
    """One forward's `Prepared`: window b's rows go to entries [length_b, length_b + R_b) of its slot
    (scratch, committed only by an encoder pass), `lmax` the arena entries attended (a graph's context
    bucket; None: what the windows need)."""
    slots = [w.slot for w in windows]
    if len(set(slots)) != len(slots):
        raise ValueError("two windows on one arena slot in a forward")
    if arena.num_layers != rt.num_layers:
        raise ValueError("arena was built for another model")
    dev = rt.device
    sizes = [w.rows for w in windows]
    offsets = [0]
    for r in sizes:
        offsets.append(offsets[-1] + r)
    ids = torch.cat([w.token_ids.to(dev) for w in windows])
    pos = torch.cat([w.positions.to(dev) for w in windows])
    starts = [arena.reserve(w.slot, w.rows) for w in windows]
    row_slot = to_device(
        torch.cat([torch.full((r,), s, dtype=torch.long) for s, r in zip(slots, sizes)]), dev
    )
    row_col = to_device(torch.cat([torch.arange(s, s + r) for s, r in zip(starts, sizes)]), dev)
    ctx = AttentionGeometry.build(
        windows, starts, rt.sliding_window, dev, lmax, arena.capacity, step=rt.context_step
    )
    ctx.kernel, ctx.kernel_rows, ctx.encoder_backend = rt.kernels, rt.kernel_rows, rt.encoder_sdpa_backend
    ctx.tiles = rt.attention_tiles
    ctx.backend = rt.encoder_sdpa_backend if encoder else rt.sdpa_backend
    sc = [] if encoder else self_cond_entries(windows, offsets, dev, rt.dtype)
    cap, cap_owner = _captured_rows(windows, offsets, dev) if not encoder and capture else (None, [])
    prep = Prepared(
        encoder,
        windows,
        offsets,
        ids,
        pos,
        row_slot,
        row_col,
        ctx,
        sc,
        cap,
        cap_owner,
        arena,
        cap_slot=None if cap is None else row_slot[cap],
        cap_col=None if cap is None else row_col[cap],
        dec_offsets=offsets,
    )
    if not encoder and any(w.encoder_rows for w in windows):
        _fold_encoder_rows(rt, prep, capture)
    return prep


def _captured_rows(windows: list[Window], offsets: list[int], dev) -> tuple[torch.Tensor | None, list]:
    """The rows whose K/V a window captures (`Window.capture`), as forward row indices, and (window,
    count) per window that has any."""
    cap_rows, cap_owner = [], []
    for b, w in enumerate(windows):
        if w.capture is not None:
            idx = torch.nonzero(w.capture.to(dev)).flatten()
            if idx.numel():
                cap_rows.append(idx + offsets[b])
                cap_owner.append((b, int(idx.numel())))
    return (torch.cat(cap_rows) if cap_rows else None), cap_owner


def _fold_encoder_rows(rt: Runtime, prep: Prepared, capture: bool) -> None:
    """Windows whose leading `encoder_rows` are an encoder pass riding in this decoder forward: which
    rows those are, and the other rows' logits offsets per window."""
    if capture and prep.cap_owner:
        raise ValueError("encoder rows and captured rows in one forward")
    if not rt.tied_weights:
        raise ValueError(
            "encoder rows in a decoder forward need the encoder's weights tied to the "
            "decoder's (this runtime's encoder has its own: fold_encode=false)"
        )
    windows, dev = prep.windows, rt.device
    prep.enc_rows = torch.cat([torch.arange(w.rows, device=dev) < w.encoder_rows for w in windows])
    prep.dec_rows = torch.nonzero(~prep.enc_rows).flatten()
    prep.dec_offsets = [0]
    for w in windows:
        prep.dec_offsets.append(prep.dec_offsets[-1] + w.rows - w.encoder_rows)


def self_cond_entries(windows: list[Window], offsets: list[int], dev, dtype: torch.dtype) -> list:
    """(rows [R] on device, keep [R, 1] or None, self_cond on device) per SC entry: one entry for all
    the windows' top-k signals of one k (one softmax and one gather for the forward, not a few
    launches per window), else one per window (full-vocabulary logits stay apart)."""
    parts = [(b, w, w.self_cond) for b, w in enumerate(windows) if w.self_cond is not None]
    ks = {sc[0].shape[-1] if isinstance(sc, tuple) else None for _, _, sc in parts}
    if len(parts) > 1 and len(ks) == 1 and None not in ks:
        rows = to_device(torch.cat([torch.arange(offsets[b], offsets[b + 1]) for b, _, _ in parts]), dev)
        keep = None
        if any(w.self_cond_rows is not None for _, w, _ in parts):
            keep = torch.cat(
                [
                    w.self_cond_rows.to(dev)
                    if w.self_cond_rows is not None
                    else torch.ones(w.rows, dtype=torch.bool, device=dev)
                    for _, w, _ in parts
                ]
            )
            keep = keep.to(dtype)[:, None]
        tops = [sc for _, _, sc in parts if isinstance(sc, tuple)]  # every one: `ks` holds no None
        payload = tuple(torch.cat([sc[i].to(dev) for sc in tops]) for i in (0, 1))
        return [(rows, keep, payload)]
    entries = []
    for b, w, sc in parts:
        rows = torch.arange(offsets[b], offsets[b + 1], device=dev)
        keep = None if w.self_cond_rows is None else w.self_cond_rows.to(dev, dtype)[:, None]
        entries.append((rows, keep, tuple(t.to(dev) for t in sc) if isinstance(sc, tuple) else sc.to(dev)))
    return entries
