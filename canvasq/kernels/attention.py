"""The runtime's attention: windows of query rows against their slots' arena entries, one launch that
writes the o_proj input directly.

`attend(q, k_arena, v_arena, slots, lmax, mask=None, bounds=None)`:
- q [B, kv, g*R, d]: the query rows with GQA folded in (the g query heads of a KV head as g*R rows,
  `Runtime`'s query layout);
- k_arena / v_arena [S, kv, C, d]: a layer's arena, read in place for the B slots `slots` (their first
  `lmax` entries: no gather copy when the slots are not consecutive);
- bounds (the kernel): which entries each row sees, from the stored positions (`Bounds`): entry c of
  window b's slot is visible to row r when c < ends[b] and lo[b, r] <= pos[c] < hi[b, r]. The kernel
  computes that per tile in registers (no [B, g*R, L] mask is built or read) and visits only the
  entries between the first and the last one any row of the window sees (`Bounds.first` / `.last`),
  so a sliding layer reads its band, not the whole context, and a short slot not the longest one;
- mask (SDPA, the twin): the same visibility as an additive [B, 1, g*R, lmax] mask (`Bounds.mask`);
- -> o [B*R, heads*d] with row b*R + r, columns of head kv*g + i, i.e. the layout o_proj reads
  (SDPA's [B, kv, g*R, d] output needed a transposing copy).

Scale 1 (DiffusionGemma normalises q and k instead). Online softmax in fp32 (exp2), P rounded to the
value dtype before the second product, as flash attention does; a row that sees no entry (padding rows:
hi 0) gives zeros, where SDPA gives NaN (the runtime drops those rows).

Why: SDPA's fixed costs per call dominate short windows (8-row windows on the H200 at the real shape:
5.6-5.7 instead of 6.0-6.3 ms per forward), and for full canvases the masked SDPA call (mem-efficient:
the full layers' head dim 512 rules out flash) reads the whole padded context and its mask. On the
H200, 32 windows of 256 rows over contexts up to 2,048: 0.65 against 1.29 ms a sliding layer, 2.5
against 4.8 ms a full one; through the worker loop at 64 slots a full step fell from 273 to 200 ms
(BENCHMARKS.md, "Service throughput"). So the runtime sends every window here (`Runtime.kernel_rows`;
0 sends every window to SDPA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._dispatch import auto_triton, interpreted, pdl_kwargs
from ._math import pdl_enter

LOG2E = tl.constexpr(1.4426950408889634)
KERNEL_ROWS = 1 << 20  # rows per window up to which the runtime attends through this kernel: every window


@dataclass(frozen=True)
class Bounds:
    """Which arena entries each query row of a forward sees, as device tensors (written inside a
    forward, so a CUDA graph replays them): entry c of window b's slot is visible to row r when
    c < ends[b] and lo[b, r] <= pos[slot, c] < hi[b, r] (`lo` None: no lower bound). Padding rows have
    hi 0. `first` / `last` [B]: the entry range [first, last) outside which no row of window b sees
    anything (`build`)."""

    pos: torch.Tensor  # [S, C] the arena's stored positions
    ends: torch.Tensor  # [B] entries of each window's slot that exist (committed + the window's own)
    hi: torch.Tensor  # [B, R] positions below hi are visible (canvas end; padding rows 0)
    lo: torch.Tensor | None  # [B, R] positions at or above lo are visible (sliding layers), or None
    first: torch.Tensor  # [B]
    last: torch.Tensor  # [B]

    @classmethod
    def build(cls, pos, key_pos, ends, hi, lo=None) -> Bounds:
        """key_pos [B, L]: the windows' slots' first L stored positions (a slice or gather of `pos`)."""
        lmax = key_pos.shape[1]
        idx = torch.arange(lmax, device=key_pos.device)
        some = (idx[None, :] < ends[:, None]) & (key_pos < hi.amax(1)[:, None])  # some row sees entry c
        if lo is not None:
            floor = torch.where(hi > 0, lo, torch.iinfo(lo.dtype).max).amin(1)
            some &= key_pos >= floor[:, None]
        first = torch.where(some, idx, lmax).amin(1)
        last = torch.where(some, idx + 1, 0).amax(1)
        return cls(pos, ends, hi, lo, first, last)

    def mask(self, key_pos, groups: int, dtype) -> torch.Tensor:
        """The additive mask SDPA takes: [B, 1, g*R, L], 0 / -inf (rows that see nothing: all -inf)."""
        see = visible(key_pos, self.ends, self.hi, self.lo)  # [B, R, L]
        nb, r, lmax = see.shape
        see = see[:, None, None].expand(nb, 1, groups, r, lmax).reshape(nb, 1, groups * r, lmax)
        return torch.zeros(see.shape, dtype=dtype, device=see.device).masked_fill_(~see, float("-inf"))


def visible(key_pos, ends, hi, lo=None) -> torch.Tensor:
    """key_pos [B, L], ends [B], hi / lo [B, R] -> [B, R, L] bool: row r of window b sees entry c
    (`Bounds`)."""
    lmax = key_pos.shape[1]
    kp = key_pos[:, None, :]
    see = (torch.arange(lmax, device=kp.device)[None, :] < ends[:, None])[:, None, :] & (kp < hi[:, :, None])
    return see if lo is None else see & (kp >= lo[:, :, None])


@triton.jit
def _attend_block(
    q, k_base, v_base, p_base, start, stop, hi_r, lo_r, sk_l, sv_l, m_i, l_i, acc, D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_BOUNDS: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Entries start .. start + BLOCK_N (those below `stop`): the online-softmax update of (row max,
    row sum, accumulator); the rows' visibility from the entries' stored positions."""
    cols_d = tl.arange(0, D)
    keys = start + tl.arange(0, BLOCK_N)
    kin = keys < stop
    k = tl.load(k_base + keys[:, None].to(tl.int64) * sk_l + cols_d[None, :], mask=kin[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * LOG2E  # [BLOCK_M, BLOCK_N] fp32, base-2 logits
    see = kin[None, :]
    if HAS_BOUNDS:
        kp = tl.load(p_base + keys, mask=kin, other=0)
        see = see & (kp[None, :] < hi_r[:, None])
        if SLIDING:
            see = see & (kp[None, :] >= lo_r[:, None])
    s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key masked so far: keep exp2 finite
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_l + cols_d[None, :], mask=kin[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, ends_ptr, hi_ptr, lo_ptr, first_ptr, last_ptr, o_ptr,
    sq_b, sq_h, sq_r, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, sp_s, so_r, R, GR, L, G,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BOUNDS: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET_STEPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M folded query rows of (window b, KV head kv) against the entries of slot
    slots[b] between its bounds' first and last (all L without bounds); writes o[b*R + r,
    (kv*G + i)*D + :] for folded row i*R + r."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < GR
    cols_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sq_b + kv * sq_h + rows[:, None].to(tl.int64) * sq_r + cols_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    slot = tl.load(slot_ptr + b).to(tl.int64)
    k_base = k_ptr + slot * sk_s + kv * sk_h
    v_base = v_ptr + slot * sv_s + kv * sv_h
    p_base = pos_ptr + slot * sp_s
    start0 = 0
    stop = L
    hi_r = tl.zeros((BLOCK_M,), tl.int64)
    lo_r = tl.zeros((BLOCK_M,), tl.int64)
    if HAS_BOUNDS:
        r_in = b * R + rows % R
        hi_r = tl.load(hi_ptr + r_in, mask=live, other=0)
        if SLIDING:
            lo_r = tl.load(lo_ptr + r_in, mask=live, other=0)
        start0 = (tl.load(first_ptr + b) // BLOCK_N) * BLOCK_N
        stop = tl.where(tl.max(hi_r) > 0, tl.load(last_ptr + b), 0)  # a tile of padding rows: nothing
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if INTERPRET_STEPS > 0:  # the CPU interpreter cannot run a loop of runtime length
        for it in tl.static_range(INTERPRET_STEPS):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, p_base, start0 + it * BLOCK_N, stop, hi_r, lo_r, sk_l, sv_l, m_i, l_i,
                acc, D, BLOCK_N, HAS_BOUNDS, SLIDING, DOT_PREC,
            )  # fmt: skip
    else:
        for start in range(start0, stop, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, p_base, start, stop, hi_r, lo_r, sk_l, sv_l, m_i, l_i, acc, D,
                BLOCK_N, HAS_BOUNDS, SLIDING, DOT_PREC,
            )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    head = kv * G + (rows // R)
    orow = b * R + (rows % R)
    tl.store(
        o_ptr + orow[:, None].to(tl.int64) * so_r + head[:, None] * D + cols_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=live[:, None],
    )


# Tiles (BLOCK_M, BLOCK_N, warps, stages) by head dim, fastest first, as the H200 probe ranked them
# (`benchmarks/probes/attention_gpu_timing.py`, 32 service windows of 256 rows; BENCHMARKS.md,
# "Service throughput"); a launch takes the first whose shared memory the device has (DGX Spark has
# ~100 KB a block: the smaller tiles, mma.sync). 64-row tiles of 4 warps are one warpgroup (wgmma on
# sm_90).
TILES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    256: ((64, 32, 4, 2), (32, 32, 4, 2)),
    512: ((64, 32, 8, 2), (32, 32, 4, 2), (16, 16, 4, 2)),
}


# tiles measured fastest although they spill a little (bytes of stack on sm_90): the 64 x 32, 4-warp tile
# at head dim 256 (651 us in the probe against 860 for the spill-free 3-stage one)
MEASURED_SPILLS = {(256, 64, 32, 4, 2): 16}


def tile_smem(d: int, tile: tuple[int, int, int, int]) -> int:
    """Shared memory a tile may stage, in bytes of a 16-bit dtype: the query block and `stages` K and V
    blocks. An upper bound: the sm_90 compile reports this (to 256 bytes) for 64-row tiles and less
    for smaller ones, whose buffers share memory (32 x 32 at head dim 512: 100,608 of 163,840)."""
    bm, bn, _, stages = tile
    return 2 * d * (bm + 2 * stages * bn)


@functools.lru_cache(maxsize=32)
def _tiles(d: int, smem: int | None = None, spec: str = "") -> tuple[int, int, int, int]:
    """The tile for head dim `d` on a device with `smem` bytes of shared memory a block (None: any):
    `spec` ("256:64x32x4x2/512:32x32x4x2", `Runtime.attention_tiles`) first, then `TILES`; head dims
    not in the table 32 x 32, 4 warps."""
    chosen = dict(item.split(":") for item in spec.split("/") if item)
    if str(d) in chosen:
        return tuple(int(x) for x in chosen[str(d)].split("x"))  # type: ignore[return-value]
    for tile in TILES.get(d, ()):
        if smem is None or tile_smem(d, tile) <= smem:
            return tile
    return 32, 32, 4, 2


@functools.lru_cache(maxsize=8)
def _device_smem(index: int) -> int:
    """Shared memory a block may opt into on CUDA device `index`, as Triton's driver reports it."""
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def _check_launch(q, k_arena, v_arena, slots, lmax: int, bounds: Bounds | None, groups: int) -> None:
    """The layouts `attend_launch` assumes (see `attend`)."""
    nb, kvh, gr, d = q.shape
    r = gr // groups
    assert k_arena.shape[1] == v_arena.shape[1] == kvh and k_arena.shape[3] == v_arena.shape[3] == d
    assert q.stride(-1) == k_arena.stride(-1) == v_arena.stride(-1) == 1 and slots.shape == (nb,)
    assert d >= 16 and triton.next_power_of_2(d) == d and gr % groups == 0, (d, gr, groups)
    assert lmax <= k_arena.shape[2]
    if bounds is not None:
        assert bounds.hi.shape == (nb, r) and bounds.hi.is_contiguous(), bounds.hi.shape
        assert bounds.lo is None or (bounds.lo.shape == (nb, r) and bounds.lo.is_contiguous())
        assert bounds.pos.stride(-1) == 1 and bounds.first.shape == bounds.last.shape == (nb,)


def attend_launch(
    q, k_arena, v_arena, slots, lmax: int, bounds: Bounds | None = None, groups: int = 1, tiles=None
) -> torch.Tensor:
    """The kernel (see `attend`); `bounds` None: every row sees the first `lmax` entries. `tiles`: a
    (BLOCK_M, BLOCK_N, warps, stages) tuple, or a `Runtime.attention_tiles` string, or None (`TILES`)."""
    _check_launch(q, k_arena, v_arena, slots, lmax, bounds, groups)
    nb, kvh, gr, d = q.shape
    g = groups
    r = gr // g
    o = torch.empty(nb * r, kvh * g * d, dtype=q.dtype, device=q.device)
    if not isinstance(tiles, tuple):
        smem = _device_smem(q.device.index or 0) if q.is_cuda else None
        tiles = _tiles(d, smem, tiles or "")
    bm, bn, warps, stages = tiles
    bd = bounds
    if o.numel():
        _attend_kernel[(triton.cdiv(gr, bm), kvh, nb)](
            q,
            k_arena,
            v_arena,
            slots,
            *(
                (bd.pos, bd.ends, bd.hi, bd.hi if bd.lo is None else bd.lo, bd.first, bd.last)
                if bd
                else (q,) * 6
            ),
            o,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_arena.stride(0),
            k_arena.stride(1),
            k_arena.stride(2),
            v_arena.stride(0),
            v_arena.stride(1),
            v_arena.stride(2),
            bd.pos.stride(0) if bd else 0,
            o.stride(0),
            r,
            gr,
            lmax,
            g,
            D=d,
            BLOCK_M=bm,
            BLOCK_N=bn,
            HAS_BOUNDS=bd is not None,
            SLIDING=bd is not None and bd.lo is not None,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 products
            INTERPRET_STEPS=triton.cdiv(lmax, bn) if interpreted(_attend_kernel) else 0,
            **pdl_kwargs(q, _attend_kernel),
            num_warps=warps,
            num_stages=stages,
        )
    return o


# the masked calls' kernels (flash takes no mask), in SDPA's fallback order after the preferred one
_SDPA_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SDPA_BACKENDS = ("auto", *_SDPA_KERNELS)


def attend_reference(
    q,
    k_arena,
    v_arena,
    slots,
    lmax: int,
    mask=None,
    groups: int = 1,
    first: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Twin: SDPA (scale 1) on the slots' arena entries, then the transposing copy. `first`: the slots
    are first, first + 1, ... (a host int), read as a slice instead of gathered. `backend`: SDPA's own
    choice ("auto") or one of `SDPA_BACKENDS` tried first for masked calls (cuDNN builds a plan per
    new shape)."""
    nb, kvh, gr, d = q.shape
    r = gr // groups
    pick = slots if first is None else slice(first, first + nb)
    k = k_arena[pick, :, :lmax]
    v = v_arena[pick, :, :lmax]
    if backend != "auto" and mask is not None:
        # preferred, not forced: a GPU or build without that kernel falls back to SDPA's others
        preferred = _SDPA_KERNELS[backend]
        with sdpa_kernel(
            [preferred] + [b for b in _SDPA_KERNELS.values() if b != preferred], set_priority=True
        ):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return o.view(nb, kvh, groups, r, d).permute(0, 3, 1, 2, 4).reshape(nb * r, kvh * groups * d)


def attend(
    q,
    k_arena,
    v_arena,
    slots,
    lmax: int,
    mask=None,
    bounds: Bounds | None = None,
    groups: int = 1,
    impl: str = "auto",
    first: int | None = None,
    backend: str = "auto",
    tiles: str = "",
) -> torch.Tensor:
    """q [B, kv, g*R, d] (g = `groups` query heads per KV head), a layer's arena K/V [S, kv, C, d], the B
    windows' slots, their first `lmax` entries, which entries each row sees (`bounds`; SDPA takes
    `mask`, else the one `bounds` gives; neither: all) -> o [B*R, kv*g*d] (see the module docstring).
    `first`: see `attend_reference` (the kernel reads any slots in place); `tiles`: see `attend_launch`."""
    if impl == "auto":
        impl = "triton" if auto_triton(q, _attend_kernel) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"unknown impl {impl!r}")
    d = q.shape[-1]
    if (
        impl == "triton"
        and d >= 16
        and triton.next_power_of_2(d) == d
        and (bounds is not None or mask is None)
    ):
        return attend_launch(q, k_arena, v_arena, slots, lmax, bounds, groups, tiles)
    if mask is None and bounds is not None:
        pick = slots if first is None else slice(first, first + q.shape[0])
        mask = bounds.mask(bounds.pos[pick, :lmax], groups, q.dtype)
    return attend_reference(q, k_arena, v_arena, slots, lmax, mask, groups, first, backend)


def compile_specs(tiles: dict[int, list[tuple[int, int, int, int]]] | None = None):
    """The kernel at the runtime's tiles for both head dims: sliding 256, full 512
    (benchmarks/kernels/compile_check.py); `tiles`: head dim -> candidate tiles instead."""
    from .compile_spec import CompileSpec

    k = _attend_kernel
    for d, bm, bn, warps, stages in (
        (dim, *t) for dim in (256, 512) for t in (tiles[dim] if tiles else [_tiles(dim)])
    ):
        consts = {
            "D": d,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "HAS_BOUNDS": True,
            "SLIDING": d == 256,
            "INTERPRET_STEPS": 0,
            "DOT_PREC": "tf32",
        }
        yield CompileSpec(
            f"attend_d{d} m{bm} n{bn} w{warps} s{stages}",
            k,
            consts,
            types={
                n: "*i64"
                for n in ("slot_ptr", "pos_ptr", "ends_ptr", "hi_ptr", "lo_ptr", "first_ptr", "last_ptr")
            },
            divisible=frozenset(n for n in k.arg_names if n.endswith("_ptr") or n.startswith("s")),
            num_warps=warps,
            num_stages=stages,
            spill_bytes=MEASURED_SPILLS.get((d, bm, bn, warps, stages), 0),
        )
