"""Per-forward attention geometry of the runtime: which arena entries each window row sees, the
masks built from stored positions inside the forward (capturable in a CUDA graph), and the attention
call itself (`kernels.attention` for short windows, SDPA otherwise)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from canvasq.kernels.attention import KERNEL_ROWS, Bounds, attend, visible
from canvasq.kernels.norm_rope import Scatter
from canvasq.model.arena import KVArena
from canvasq.model.windows import Window, to_device


@dataclass
class AttentionGeometry:
    """Per-forward attention geometry: query blocks (the windows; see `build`) padded to [B, Rmax]
    queries over the first Lmax arena entries of their slots. Host ints and index tensors are fixed
    at `build`; the per-row bounds (`hi`, `lo`), visible-entry counts (`ends`) and padding flags are
    device tensors, and the kernel's bounds or SDPA's masks are computed from them and the stored
    positions inside the forward (`build_masks`), so a CUDA graph replays correctly after those
    tensors are overwritten."""

    slots: torch.Tensor  # [B] arena slot of each block
    first: int  # slot of the first window
    # leading blocks on slots first, first + 1, ... (every window's block, when the windows come in slot
    # order; else 0): the arena is sliced for them, not gathered
    sliced: int
    b_idx: torch.Tensor  # [N] block of each row
    r_idx: torch.Tensor  # [N] row within its block
    rmax: int  # rows of the largest window (queries are padded to it)
    lmax: int  # arena entries attended (context bucket)
    dense: bool  # the rows are the blocks' rows in order, each block rmax rows (no padding rows)
    hi: torch.Tensor  # [B, Rmax] keys with position < hi are visible (canvas end)
    lo: torch.Tensor  # [B, Rmax] sliding layers: keys with position >= lo (canvas start - (W - 1))
    ends: torch.Tensor  # [B] visible entries per block: its slot's committed + its window's own
    pad: torch.Tensor  # [B, Rmax] padding query rows
    # every block sees all lmax entries of its slot (host ints): without it no mask can be all-visible,
    # so `build_masks` answers "masked" without the device check's host sync
    all_at_lmax: bool = True
    masks: dict[bool, torch.Tensor] = field(default_factory=dict)  # sliding? -> [B, 1, Rmax, L] bool (SDPA)
    bounds: dict[bool, Bounds] = field(default_factory=dict)  # sliding? -> the kernel's bounds
    maskfree: dict[bool, bool] = field(default_factory=lambda: {False: False, True: False})
    backend: str = "auto"  # SDPA backend of masked calls (`kernels.attention.SDPA_BACKENDS`)
    encoder_backend: str = "auto"  # ... of the calls on encoder blocks alone (their shapes vary more)
    kernel: bool = False  # short windows through `kernels.attention` (the runtime's `kernels`), else SDPA
    kernel_rows: int = KERNEL_ROWS  # rows per window up to which `kernel` applies (`Runtime.kernel_rows`)
    # the kernel's tiles by head dim (`Runtime.attention_tiles`; "": `kernels.attention.TILES`)
    tiles: str = ""
    _folded: dict[tuple[bool, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        windows: list[Window],
        starts: list[int],
        sliding_window: int,
        dev,
        lmax: int | None,
        capacity: int,
        step: int = 0,
    ):
        """Query blocks are the windows, except that a window's leading `encoder_rows` become a block
        of their own on the same slot, after all the windows' blocks: a folded encoder pass then adds
        a few blocks of at most a canvas's rows instead of padding every window's queries to its own
        rows plus a canvas, and the windows' blocks keep their slot order (read as a slice). Both
        blocks of a window see the window's scratch rows; the rows' bounds keep the encoder rows
        causal. `step` (eager forwards): when the slots' visible entries differ (a mask is needed
        anyway), the context is rounded up to a multiple of `step`."""
        sizes = [w.rows for w in windows]
        ends = [s + r for s, r in zip(starts, sizes)]  # visible entries per slot: committed + window
        lmax = _context_bucket(ends, lmax, capacity, step)
        blocks, n_windows, row0 = _query_blocks(windows, ends)
        extra = len(blocks) > n_windows
        rmax = max(n for *_, n in blocks)
        b_idx, r_idx = _row_index(blocks, row0)
        b_idx, r_idx = to_device(b_idx, dev), to_device(r_idx, dev)
        nb = len(blocks)
        slots = to_device([s for s, *_ in blocks], dev)
        first = windows[0].slot
        in_order = n_windows == len(windows) and all(w.slot == first + b for b, w in enumerate(windows))
        hi = torch.zeros(nb, rmax, dtype=torch.long, device=dev)
        lo = torch.zeros(nb, rmax, dtype=torch.long, device=dev)
        hi[b_idx, r_idx] = torch.cat([w.canvas_end.to(dev) for w in windows])
        lo[b_idx, r_idx] = torch.cat([w.canvas_start.to(dev) for w in windows]) - (sliding_window - 1)
        pad = torch.ones(nb, rmax, dtype=torch.bool, device=dev)
        pad.index_put_((b_idx, r_idx), torch.zeros((), dtype=torch.bool, device=dev))
        dense = not extra and all(r == rmax for r in sizes)  # rows are the blocks' rows, in order
        return cls(
            slots=slots,
            first=first,
            sliced=n_windows if in_order else 0,
            b_idx=b_idx,
            r_idx=r_idx,
            rmax=rmax,
            lmax=lmax,
            dense=dense,
            hi=hi,
            lo=lo,
            ends=to_device([e for _, e, *_ in blocks], dev),
            pad=pad,
            all_at_lmax=all(e == lmax for _, e, *_ in blocks),
        )

    @property
    def contiguous(self) -> bool:
        """Every block's slot is first, first + 1, ...: the whole arena read is one slice."""
        return self.sliced == self.hi.shape[0]

    def build_masks(self, arena: KVArena, detect_maskfree: bool = False) -> None:
        """Per layer type (sliding?): the kernel's `Bounds` when this forward's attention is ours
        (`impl`), else SDPA's boolean masks [B, 1, Rmax, L] (padding rows see entry 0, so SDPA's
        softmax stays finite) and, with `detect_maskfree`, whether a mask is needed at all (a host
        sync, skipped when a block sees fewer than lmax entries: ragged contexts always mask)."""
        nb, lmax = self.hi.shape[0], self.lmax
        if self.contiguous:
            key_pos = arena.pos[self.first : self.first + nb, :lmax]
        else:
            key_pos = arena.pos[self.slots, :lmax]
        self._folded = {}
        self.maskfree = {False: False, True: False}
        self.masks, self.bounds = {}, {}
        if self.impl == "triton":
            self.bounds = {
                sl: Bounds.build(arena.pos, key_pos, self.ends, self.hi, self.lo if sl else None)
                for sl in (False, True)
            }
            if detect_maskfree and self.all_at_lmax:  # all-visible: SDPA's flash kernel, unmasked, beats ours
                self.maskfree = self._all_visible(key_pos)
            return
        first_col = torch.arange(lmax, device=key_pos.device) == 0  # no host scalar: capturable in a graph
        pad = self.pad[:, :, None] & first_col  # padded query rows attend to entry 0: softmax stays finite
        full = visible(key_pos, self.ends, self.hi)  # [B, Rmax, L]; the band narrows it
        slide = full & (key_pos[:, None, :] >= self.lo[:, :, None])
        self.masks = {False: (full | pad)[:, None], True: (slide | pad)[:, None]}
        if detect_maskfree and self.all_at_lmax:
            # Prefix attention: when every real row sees every entry [0, L) of its slot
            # (one canvas, context before it, band not clipping, equal lengths), drop the mask so
            # SDPA can take its flash / mem-efficient path. One host sync per eager forward.
            flags = torch.stack([(self.masks[sl][:, 0] | self.pad[:, :, None]).all() for sl in (False, True)])
            self.maskfree = dict(zip((False, True), flags.tolist()))

    def _all_visible(self, key_pos: torch.Tensor) -> dict[bool, bool]:
        """Per layer type: every real row sees every entry [0, L) of its slot (the prefix case
        `build_masks` detects), from the bounds alone. One host sync."""
        full = (self.ends == self.lmax).all() & ((self.hi > key_pos.amax(1)[:, None]) | self.pad).all()
        band = ((self.lo <= key_pos.amin(1)[:, None]) | self.pad).all()
        return dict(zip((False, True), torch.stack([full, full & band]).tolist()))

    def _mask(self, sliding: bool, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, g*Rmax, L] additive mask (0 / -inf in the query dtype, built once per forward and
        layer type): the row mask repeated for the g query heads that share a KV head."""
        key = (sliding, groups)
        if key not in self._folded:
            m = self.masks[sliding]
            nb, _, r, l = m.shape
            m = m[:, :, None].expand(nb, 1, groups, r, l).reshape(nb, 1, groups * r, l)
            self._folded[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                ~m, float("-inf")
            )
        return self._folded[key]

    def query_target(self, heads: int, d: int, dtype: torch.dtype) -> Scatter:
        """Where the q-norm + RoPE puts the window rows' queries: [B, h, Rmax, d], row r of window b
        at [b, :, r] (padding rows zero). Viewed as [B, kv, g*Rmax, d] that is the folded GQA layout
        `attend` hands to SDPA."""
        nb = self.hi.shape[0]
        make = torch.empty if self.dense else torch.zeros
        dst = make(nb, heads, self.rmax, d, dtype=dtype, device=self.hi.device)
        return Scatter(dst, self.b_idx, self.r_idx)

    @property
    def impl(self) -> str:
        """ "triton" (our kernel: the arena read in place) for windows of up to `kernel_rows` rows
        when the runtime has its kernels, else "torch" (SDPA)."""
        return "triton" if self.kernel and self.rmax <= self.kernel_rows else "torch"

    def attend(self, layer: int, arena: KVArena, q: torch.Tensor, sliding: bool) -> torch.Tensor:
        """q: [B, h, Rmax, d] (`query_target`) -> [N, h*d]. GQA is folded into the query rows (the g
        query heads of a KV head become g*Rmax rows against that head's keys), so K/V are read in
        place, never repeated."""
        nb, heads, _, d = q.shape
        kvh = arena.k[layer].shape[1]
        g = heads // kvh
        # ours: one launch, arena read in place, visibility from the bounds, o_proj's layout out; an
        # all-visible layer type: SDPA without a mask
        impl = "torch" if self.maskfree[sliding] else self.impl
        bounds = self.bounds.get(sliding) if impl == "triton" else None
        mask = None if impl == "triton" or self.maskfree[sliding] else self._mask(sliding, g, q.dtype)
        q = q.view(nb, kvh, g * self.rmax, d)
        k, v = arena.k[layer], arena.v[layer]
        n = self.sliced
        if impl == "torch" and 0 < n < nb:  # the windows' blocks as a slice, the encoder blocks gathered
            parts = [
                attend(
                    q[:n],
                    k,
                    v,
                    self.slots[:n],
                    self.lmax,
                    None if mask is None else mask[:n],
                    groups=g,
                    impl=impl,
                    first=int(self.first),
                    backend=self.backend,
                ),
                attend(
                    q[n:],
                    k,
                    v,
                    self.slots[n:],
                    self.lmax,
                    None if mask is None else mask[n:],
                    groups=g,
                    impl=impl,
                    backend=self.encoder_backend,
                ),
            ]
            o = torch.cat(parts)
        else:
            o = attend(
                q,
                k,
                v,
                self.slots,
                self.lmax,
                mask,
                bounds,
                groups=g,
                impl=impl,
                first=int(self.first) if self.contiguous else None,
                backend=self.backend,
                tiles=self.tiles,
            )
        return o if self.dense else o.view(nb, self.rmax, heads * d)[self.b_idx, self.r_idx]


def _context_bucket(ends: list[int], lmax: int | None, capacity: int, step: int) -> int:
    """Arena entries attended: the given bucket (checked), else the most visible, rounded up to `step`
    when masked anyway."""
    need = max(ends)
    if lmax is None:
        lmax = need
        if step and len(set(ends)) > 1:  # masked anyway: a context bucket, so SDPA meets shapes it has seen
            lmax = min(capacity, -(-need // step) * step)
    elif lmax < need or lmax > capacity:
        raise ValueError(f"context bucket {lmax} outside [{need}, {capacity}]")
    return lmax


def _query_blocks(windows: list[Window], ends: list[int]) -> tuple[list[tuple[int, int, int, int]], int, int]:
    """The query blocks (windows' blocks, then encoder blocks), how many are windows' and the rows."""
    # (slot, visible entries, first row in the forward, rows) per query block; encoder rows in
    # chunks of at most the windows' largest block (a long prompt is several causal blocks)
    sizes = [w.rows for w in windows]
    chunk = max([w.rows - w.encoder_rows for w in windows if w.rows > w.encoder_rows] or [max(sizes)])
    blocks, extra, row0 = [], [], 0
    for w, end in zip(windows, ends):
        e = w.encoder_rows
        extra += [(w.slot, end, row0 + c, min(chunk, e - c)) for c in range(0, e, chunk)]
        if w.rows > e:
            blocks.append((w.slot, end, row0 + e, w.rows - e))
        row0 += w.rows
    return blocks + extra, len(blocks), row0


def _row_index(blocks: list[tuple[int, int, int, int]], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block of each row and row within its block (host tensors of `rows`)."""
    b_idx = torch.empty(rows, dtype=torch.long)
    r_idx = torch.empty(rows, dtype=torch.long)
    for b, (_, _, r0, n) in enumerate(blocks):
        b_idx[r0 : r0 + n] = b
        r_idx[r0 : r0 + n] = torch.arange(n)
    return b_idx, r_idx
