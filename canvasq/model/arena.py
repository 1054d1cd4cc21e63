"""KV arena: preallocated per-layer K/V buffers with the absolute position of every entry.

The arena is what the encoder writes and the decoder reads ("scattered KV promotion"). One *slot* per sequence in flight; a slot holds that sequence's committed context: the
prompt, committed canvases (encoder pass, or promoted decoder K/V) in whatever order they arrived.
Entries need not be sorted by position: RoPE is baked into the keys at the token's true position and
every mask is computed from the stored positions, never from the entry index.

Memory layout (S slots, C capacity entries per slot, per layer l with its own kv heads h_l and head
dim d_l; sliding and full layers differ):

    k[l]:  [S, h_l, C, d_l]   model dtype      RoPE'd, k-normed keys
    v[l]:  [S, h_l, C, d_l]   model dtype      v-normed values
    pos:   [S, C]             int64            absolute position of entry c (shared by all layers)
    length:[S]                int64 (host)     entries [0, length) are committed context

            slot s:  | committed entries (prompt, canvases, promoted rows) | scratch ............ |
                     0                                                 length[s]              C
                                                                        ^ a decoder forward writes
                                                                          its window rows here

Why V has its own buffer even on the "V = K" full layers: those layers project V with k_proj, but
K is k-normed *with* a learned scale and rotated, V is normed without scale and not rotated, so the
two tensors differ; sharing one buffer would mean re-deriving K (scale + RoPE) from V on every read.

A decoder forward writes its window's K/V and positions into the scratch region after `length`
(`reserve`, `write_rows`), attends to `[0, length + R)` under masks built from positions, and never advances
`length`; so a decoder forward leaves the committed context untouched. `append` (encoder),
`promote` (captured decoder rows) and `promote_window` (rows of the last window, straight from the
scratch, left-compacted) advance `length`. `compact` drops entries (left-compaction of the
kept rows), `reset` frees a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Captured:
    """K/V of selected window rows, taken during a decoder forward, for `KVArena.promote`.

    k[l], v[l]: [n, h_l, d_l] model dtype; positions: [n] int64.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    positions: torch.Tensor

    def __len__(self) -> int:
        return int(self.positions.numel())

    def select(self, rows: torch.Tensor | list[int]) -> Captured:
        """A subset (or reorder) of the captured rows."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.positions.device)
        return Captured([k[idx] for k in self.k], [v[idx] for v in self.v], self.positions[idx])


class KVArena:
    """Per-layer K/V buffers for `slots` sequences of up to `capacity` entries each."""

    def __init__(
        self,
        layer_shapes: list[tuple[int, int]],
        slots: int,
        capacity: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        """layer_shapes: (kv_heads, head_dim) per layer, as `Runtime.layer_shapes` gives them."""
        self.slots, self.capacity = slots, capacity
        self.device, self.dtype = torch.device(device), dtype
        self.k = [torch.zeros(slots, h, capacity, d, device=device, dtype=dtype) for h, d in layer_shapes]
        self.v = [torch.zeros(slots, h, capacity, d, device=device, dtype=dtype) for h, d in layer_shapes]
        self.pos = torch.zeros(slots, capacity, dtype=torch.long, device=device)
        self.length = [0] * slots  # host ints: shapes depend on them, keep them off the device

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + self.pos.numel() * 8

    @staticmethod
    def bytes_for(layer_shapes: list[tuple[int, int]], slots: int, capacity: int, dtype: torch.dtype) -> int:
        """What `KVArena(layer_shapes, slots, capacity, dtype=dtype).nbytes()` will be, before allocating."""
        per_entry = sum(2 * h * d for h, d in layer_shapes) * dtype.itemsize + 8
        return slots * capacity * per_entry

    # --- reads -------------------------------------------------------------------------------------
    def prefix(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a slot's committed context at one layer: k, v [h, L, d] and positions [L]."""
        n = self.length[slot]
        return self.k[layer][slot, :, :n], self.v[layer][slot, :, :n], self.pos[slot, :n]

    def positions(self, slot: int) -> torch.Tensor:
        return self.pos[slot, : self.length[slot]]

    # --- writes ------------------------------------------------------------------------------------
    def _check_room(self, slot: int, n: int) -> None:
        if self.length[slot] + n > self.capacity:
            raise ValueError(
                f"arena slot {slot} full: {self.length[slot]} + {n} entries > capacity {self.capacity}"
            )

    def reserve(self, slot: int, n: int) -> int:
        """Check room for a window of n rows in the slot's scratch region; returns its start index.
        The runtime writes the rows' positions and K/V there during the forward (`write_rows`)."""
        self._check_room(slot, n)
        return self.length[slot]

    def write_rows(
        self, layer: int, slots: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v: [N, h, d] rows; row i goes to (slots[i], cols[i]) of `layer`."""
        self.k[layer][slots, :, cols] = k.to(self.dtype)
        self.v[layer][slots, :, cols] = v.to(self.dtype)

    def commit(self, slot: int, n: int) -> None:
        """The n scratch entries after `length` become committed context (the encoder's append)."""
        self._check_room(slot, n)
        self.length[slot] += n

    def append(
        self, slot: int, k: list[torch.Tensor], v: list[torch.Tensor], positions: torch.Tensor
    ) -> None:
        """Append entries given as per-layer [n, h, d] tensors (plus positions [n])."""
        n = int(positions.numel())
        if n == 0:
            return
        self._check_room(slot, n)
        start = self.length[slot]
        cols = torch.arange(start, start + n, device=self.device)
        slots = torch.full_like(cols, slot)
        for layer in range(self.num_layers):
            self.write_rows(layer, slots, cols, k[layer], v[layer])
        self.pos[slot, start : start + n] = positions.to(self.pos.device, torch.long)
        self.length[slot] += n

    def promote(self, slot: int, captured: Captured, rows: torch.Tensor | list[int] | None = None) -> None:
        """Append captured decoder rows (all, or the subset `rows` of them) to a slot's context.

        Promote one step late: capture a committed token's K/V on the forward *after* its commit,
        when it rode the window with its final id; otherwise the cache holds a draft token's K/V.
        """
        if rows is not None:
            captured = captured.select(rows)
        self.append(slot, captured.k, captured.v, captured.positions)

    def promote_window(self, slot: int, rows: torch.Tensor | list[int]) -> None:
        """Promote rows of the slot's last decoder window straight from its scratch region: window row
        r sits at entry length + r until the next forward on this slot, so the kept rows are
        left-compacted onto [length, length + n) and `length` advances (no `Captured` copy; this is
        how a `DecodeGraph` step promotes). `rows`: window row indices, ascending."""
        src = torch.as_tensor(rows, dtype=torch.long, device=self.device).flatten()
        n = int(src.numel())
        if n == 0:
            return
        self._check_room(slot, n)
        start = self.length[slot]
        src = src + start
        dst = torch.arange(start, start + n, device=self.device)
        for layer in range(self.num_layers):  # dst <= src elementwise: the gather reads before it writes
            self.k[layer][slot, :, dst] = self.k[layer][slot, :, src]
            self.v[layer][slot, :, dst] = self.v[layer][slot, :, src]
        self.pos[slot, dst] = self.pos[slot, src]
        self.length[slot] += n

    def compact(self, slot: int, keep: torch.Tensor) -> None:
        """Keep only the committed entries where `keep` ([length] bool) is true, left-compacted in
        their current order."""
        n = self.length[slot]
        idx = torch.nonzero(keep.to(self.device)[:n]).flatten()
        m = int(idx.numel())
        for layer in range(self.num_layers):
            self.k[layer][slot, :, :m] = self.k[layer][slot, :, idx]
            self.v[layer][slot, :, :m] = self.v[layer][slot, :, idx]
        self.pos[slot, :m] = self.pos[slot, idx]
        self.length[slot] = m

    def truncate(self, slot: int, n: int) -> None:
        """Drop entries after the first n (e.g. undo a speculative append)."""
        self.length[slot] = min(self.length[slot], n)

    def reset(self, slot: int) -> None:
        self.length[slot] = 0
