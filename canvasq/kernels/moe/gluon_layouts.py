"""The register layouts of the Gluon W4 kernels' operand tiles (`gluon_w4.py`), spelled out so that a
lane's loads are the MMA's registers as they are: the packed weight words in `gluon_pack.tile_q`'s
order, the activation pairs in `gluon_pack.mma_k`'s, and the coalesced layout cp.async copies them in.
Each is a `gluon.constexpr_function` of the tile's sizes (BN, BM weight / token rows, G the group,
NW warps, STAGES the shared-memory stages).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def word_layout(BN, G, NW):
    """Layout of a [BN, G/8] int32 tile of packed words: lane 4g + c holds words c*NH .. c*NH + NH - 1
    of rows g and g + 8 (one vector load each); warps stacked along rows, then further row tiles."""
    nh = G // 32
    reg = [[0, 1 << i] for i in range(nh.bit_length() - 1)] + [[8, 0]]
    rows = 16 * NW
    while rows < BN:
        reg.append([rows, 0])
        rows *= 2
    lanes = [[0, nh], [0, 2 * nh], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(NW.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lanes, warps, [], [BN, G // 8])


@gluon.constexpr_function
def act_layout(BM, G, NW):
    """Layout of a [BM, G/2] int32 tile of activation pairs (real order) that `gluon_w4._act_tile`
    turns into the MMA's B operand [G, BM] with register renaming only: lane 4g + c holds real pairs
    8c .. 8c + 7 of each 64-k block of token g (two 16-byte loads)."""
    reg = [[0, 1], [0, 2], [0, 4]] + ([[0, 32]] if G == 128 else [])
    rows = 8
    while rows < BM:
        reg.append([rows, 0])
        rows *= 2
    lanes = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
    warps = [[0, 0]] * (NW.bit_length() - 1)
    return gl.DistributedLinearLayout(reg, lanes, warps, [], [BM, G // 2])


@gluon.constexpr_function
def copy_layout(BM, G, NW):
    """A coalesced layout for copying the [BM, G/2] int32 activation tile: 16 bytes a lane."""
    return gl.BlockedLayout([1, 4], [32 * 4 // (G // 2), G // 2 // 4], [NW, 1], [1, 0])


@gluon.constexpr_function
def act_load_layout(BM, G, NW, STAGES):
    """Where the activation offsets live: the MMA-ready layout when each lane loads its own pairs
    (STAGES = 0), the coalesced copy layout when cp.async stages them through shared memory."""
    return copy_layout(BM, G, NW) if STAGES else act_layout(BM, G, NW)
