"""The host side of the Gluon W4 kernels (`gluon_w4.py`): the tiled byte order their lanes load
(`tile_q`, with the MMA's k order `mma_k` and the nibbles' order in a word `NIBBLE_K`), the PTX that
turns one such word into dequantised pairs, and the per-row scale/zero words (`pack_scale_zero`).
Torch only: `quant.W4Experts.to_tiled` packs with it on any device, the tests check it on CPU.

Letters as in `kernels.py`; HB = G/2 packed bytes per row per group.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16  # rows of one mma.m16n8k16 A operand

# One 32-bit word holds 8 consecutive k of a row; nibble n (bits 4n..4n+3) is k = 2n for n < 4 and
# k = 2(n - 4) + 1 for n >= 4, so `(w >> 4i) & 0x000F000F` is the pair (k 2i, k 2i + 1) in the low and
# high halves: or-ing in the magic exponent makes it (magic + q) twice, and one fma with 1.0 subtracts
# the row's (magic + zero) ($5, both halves) exactly: q - zero is a small integer.
_WORD_PTX = """
{
.reg .b32 one, s1, s2, s3, t0, t1, t2, t3;
mov.b32 one, ONE;
shr.u32 s1, $4, 4;
shr.u32 s2, $4, 8;
shr.u32 s3, $4, 12;
lop3.b32 t0, $4, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t1, s1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t2, s2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t3, s3, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $0, t0, one, $5;
fma.rn.TY $1, t1, one, $5;
fma.rn.TY $2, t2, one, $5;
fma.rn.TY $3, t3, one, $5;
}
"""
WORD_PTX_BF16 = _WORD_PTX.replace("MAGIC", "0x43004300").replace("TY", "bf16x2").replace("ONE", "0x3F803F80")
WORD_PTX_FP16 = _WORD_PTX.replace("MAGIC", "0x64006400").replace("TY", "f16x2").replace("ONE", "0x3C003C00")
NIBBLE_K = (0, 2, 4, 6, 1, 3, 5, 7)  # k within the word of nibble n


def mma_k(group: int) -> torch.Tensor:
    """The real k (activation column within a group) behind each of the MMA's logical k. The
    operands' logical k are in Triton's k_width = 8 order, where one `mma.m16n8k16` takes each lane's
    activation pairs 4c + i and 16 + 4c + i of a 64-k block; giving those two logical pairs the
    adjacent real pairs 8c + 2i and 8c + 2i + 1 lets a lane's 16-byte shared-memory load be the MMA's
    B registers as they are (no moves). Logical pair L = 32b + 16h + 4c + i <-> real pair
    m = 32b + 8c + 2i + h; `_act_tile` applies the same map to the activations."""
    L = torch.arange(group // 2)
    b, h, c, i = L // 32, (L // 16) % 2, (L // 4) % 4, L % 4
    m = 32 * b + 8 * c + 2 * i + h
    return torch.stack([2 * m, 2 * m + 1], dim=-1).reshape(group)


def tile_q(q: torch.Tensor, group: int) -> torch.Tensor:
    """K-contiguous packed bytes [E, N, Kp/2] (`quant.py`) -> int32 words [E, N/16, Kp/G, 2G], the
    order the Gluon kernels' lanes load. Word p = c*NH + h (NH = G/32) of row r = 8rr + g holds logical
    k = 32h + 8c .. + 7 of the group (real k: `mma_k`; nibbles as `NIBBLE_K`) and sits at
    32*NH*rr + NH*(4g + c) + h of its 16-row tile's group: a lane's NH words of a row are one vector
    load, and a warp's load is contiguous."""
    E, N, KB = q.shape
    hb = group // 2
    assert N % TILE_ROWS == 0 and KB % hb == 0 and group % 64 == 0, (q.shape, group)
    ng, nh = KB // hb, group // 32
    b = q.reshape(E, N, ng, hb).to(torch.int32)
    nib = torch.cat([b & 0xF, b >> 4], dim=-1)  # [E, N, ng, G]: real k = j (low nibble), HB + j (high)
    nib = nib[..., mma_k(group).to(q.device)].reshape(E, N, ng, nh, 4, 8)  # logical k = 32h + 8c + kin
    word = torch.zeros(E, N, ng, nh, 4, dtype=torch.int32, device=q.device)
    for n, kin in enumerate(NIBBLE_K):
        word |= nib[..., kin] << (4 * n)
    word = word.reshape(E, N // TILE_ROWS, 2, 8, ng, nh, 4)  # E, tile, rr, g, group, h, c
    return word.permute(0, 1, 4, 2, 3, 6, 5).contiguous().reshape(E, N // TILE_ROWS, ng, 2 * group)


def untile_q(qt: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `tile_q` (tests)."""
    E, T, ng, _ = qt.shape
    nh, hb = group // 32, group // 2
    word = qt.reshape(E, T, ng, 2, 8, 4, nh).permute(0, 1, 3, 4, 2, 6, 5)  # E, tile, rr, g, group, h, c
    nib = torch.stack([(word >> (4 * n)) & 0xF for n in range(8)], dim=-1)  # [..., h, c, n]
    logical = nib[..., [NIBBLE_K.index(k) for k in range(8)]].reshape(E, T * TILE_ROWS, ng, 2 * hb)
    nib = torch.empty_like(logical)
    nib[..., mma_k(group).to(qt.device)] = logical
    return (nib[..., :hb] | (nib[..., hb:] << 4)).to(torch.uint8).reshape(E, T * TILE_ROWS, ng * hb)


MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # the magic float the nibbles are or-ed into


def pack_scale_zero(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [E, ng, N] (fp16/bf16, zero integer-valued) -> int32 words [E, ng, N]: the scale's bits
    in the low half and -(magic + zero)'s in the high half, both in the scale dtype (exact: magic + 15
    has 8 significant bits). One load gives a row's scale and the PTX's zero operand (`_group_mma`)."""
    lo = scale.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    nz = (-(zero.float() + MAGIC[scale.dtype])).to(scale.dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    word = lo | (nz << 16)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_scale_zero(sz: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_scale_zero` (tests)."""
    w = sz.to(torch.int64) & 0xFFFFFFFF
    half = lambda v: torch.where(v >= 2**15, v - 2**16, v).to(torch.int16).view(dtype)
    scale, nz = half(w & 0xFFFF), half(w >> 16)
    return scale, (-nz.float() - MAGIC[dtype]).to(dtype)


def tile_q8(q: torch.Tensor, group: int) -> torch.Tensor:
    """K-contiguous packed bytes [E, N, K/2] (`quant.py`) -> [E, N/16, K/G, 8G] uint8, the order the
    W4A8 wgmma kernel's lanes load (`gluon_w4a8.py`): the bytes are the pack's own, only moved. In each
    16-row tile and group, lane 4g + t holds G/4 contiguous bytes; its byte 8j + 4r + b is the pack's
    byte 16j + 4t + b of the group's G/2, row 8r + g: wgmma's A registers for an e4m3 operand
    (k_width 4) of the low nibbles and, the same bytes shifted, of the high ones."""
    E, N, KB = q.shape
    hb = group // 2
    assert N % TILE_ROWS == 0 and KB % hb == 0 and group in (64, 128), (q.shape, group)
    t = q.reshape(E, N // TILE_ROWS, 2, 8, KB // hb, hb // 16, 4, 4)  # E, T, r, g, group, j, t, b
    return t.permute(0, 1, 4, 3, 6, 5, 2, 7).contiguous().reshape(E, N // TILE_ROWS, KB // hb, 8 * group)


def untile_q8(q8: torch.Tensor) -> torch.Tensor:
    """Inverse of `tile_q8` (tests, the CPU twin)."""
    E, T, ng, lane_bytes = q8.shape
    hb = lane_bytes // 16
    t = q8.reshape(E, T, ng, 8, 4, hb // 16, 2, 4)  # E, T, group, g, t, j, r, b
    return t.permute(0, 1, 6, 3, 2, 5, 4, 7).contiguous().reshape(E, T * TILE_ROWS, ng * hb)


def pack_scale_zero8(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """bf16 scale, zero [E, ng, N] -> int32 words [E, ng, N], the scale's bits low and the zero's high:
    the W4A8 kernel reads a row's group as one word and widens each half to fp32 with a shift or a mask."""
    assert scale.dtype == zero.dtype == torch.bfloat16, (scale.dtype, zero.dtype)
    lo = scale.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return lo | (zero.contiguous().view(torch.int16).to(torch.int32) << 16)


def unpack_scale_zero8(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_scale_zero8`: (scale, zero), bf16."""
    scale = (words << 16).view(torch.float32).to(torch.bfloat16)
    return scale, (words & -65536).view(torch.float32).to(torch.bfloat16)
