"""W4A16 packing of MoE expert weights: asymmetric uint4, one scale + zero per group, two nibbles a byte.

Letters: E experts, H hidden width, I expert (intermediate) width, N output columns of a projection,
K its reduction width, G group size along K, Kp = K rounded up to a multiple of G.

HF layout in:   gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]  (N-major, K last)
Packed layout out (one projection; gate/up: N = 2I, K = H, G = 128; down: N = H, K = I, G = 64):

    q     [E, N, Kp/2] uint8   byte g*G/2 + j of row n holds k = g*G + j       in the low nibble
                               and                        k = g*G + G/2 + j in the high nibble
    scale [E, Kp/G, N] fp16/bf16
    zero  [E, Kp/G, N] same dtype, integer values 0..15

    w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Why this layout: K is the contiguous axis of q, so the bytes an MMA operand needs for consecutive k sit in
one 32-bit word: the kernels load a [BLOCK_N, G/2] byte tile (one row of G/2 consecutive bytes per
column), transpose it in registers and turn four bytes into eight bf16/fp16 weights with two `prmt` and
four `lop3` on 32-bit words (kernels.py, `_nibbles`). (The first layout, [E, Kp/2, N] with N contiguous,
made the compiler fetch the operand from shared memory one byte at a time: 707 instructions per gate_up
iteration against 472.) Scales and zeros keep N contiguous: a group's are one contiguous BLOCK_N vector.
Splitting each group in halves (not even/odd k) lets the kernel use the low and the high nibbles as two
separate K = G/2 operands of `tl.dot` against the two contiguous halves of the activation tile, with no
register shuffle to interleave them. K is zero-padded to Kp (704 = 11 x 64 and 2816 = 22 x 128 need no
padding at the real shape; odd test widths do).

On CUDA the runtime keeps the bytes in another order instead (`to_tiled`, `gluon_pack.tile_q`): the
same nibbles as int32 words [E, N/16, Kp/G, 2G], the order the Gluon kernels' lanes load; `tiled` says
which one a W4Experts holds. Only the Gluon kernels read the tiled order; the torch twin untiles it.

Quantisation error: the group range is widened to include 0 (so padding and zero weights stay exact),
scale = (max - min) / 15 rounded to the storage dtype first, zero = round(-min / scale); every element
is within about scale / 2 of its dequantised value (`max_abs_error_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

# the packed layout above, recorded in cached files (store.py): a file written for another layout is repacked
PACK_LAYOUT = "q[E,N,Kp/2]:k,k+G/2"


@dataclass(frozen=True)
class W4Config:
    """How experts are quantised. `scale_dtype=None` keeps the weights' own dtype (fp16/bf16/fp32)."""

    group_gate_up: int = 128
    group_down: int = 64
    scale_dtype: torch.dtype | None = None

    def __post_init__(self):
        for g in (self.group_gate_up, self.group_down):
            assert g >= 32 and g % 32 == 0 and (g & (g - 1)) == 0, f"group size {g}: power of two >= 32"


@dataclass
class W4Experts:
    """One MoE layer's experts in W4A16. Shapes in the module docstring."""

    gate_up_q: torch.Tensor  # [E, 2I, Hp/2] uint8 (tiled: [E, 2I/16, Hp/Gg, 2Gg] int32)
    gate_up_scale: torch.Tensor  # [E, Hp/Gg, 2I]
    gate_up_zero: torch.Tensor  # [E, Hp/Gg, 2I]
    down_q: torch.Tensor  # [E, H, Ip/2] uint8 (tiled: [E, H/16, Ip/Gd, 2Gd] int32)
    down_scale: torch.Tensor  # [E, Ip/Gd, H]
    down_zero: torch.Tensor  # [E, Ip/Gd, H]
    hidden: int  # H
    inter: int  # I
    config: W4Config = field(default_factory=W4Config)
    tiled: bool = False  # q in the Gluon kernels' order (`to_tiled`), not the K-contiguous one
    # tiled packs: each group's scale and -(magic + zero) as one int32 word per row [E, ng, N]
    # (`gluon_pack.pack_scale_zero`), what the Gluon kernels load; scale/zero above stay for the twin
    gate_up_sz: torch.Tensor | None = None
    down_sz: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> W4Experts:
        # packs are never written after packing: a deep-copied module tree (the D2F merge copy, a W4
        # twin of a model already packed) shares them instead of holding the experts twice
        return self

    @property
    def num_experts(self) -> int:
        return self.gate_up_q.shape[0]

    @property
    def device(self) -> torch.device:
        return self.gate_up_q.device

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.gate_up_scale.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "gate_up_q": self.gate_up_q,
            "gate_up_scale": self.gate_up_scale,
            "gate_up_zero": self.gate_up_zero,
            "down_q": self.down_q,
            "down_scale": self.down_scale,
            "down_zero": self.down_zero,
        }
        if self.tiled:
            assert self.gate_up_sz is not None and self.down_sz is not None  # set with `tiled`
            out.update(gate_up_sz=self.gate_up_sz, down_sz=self.down_sz)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def expert_nbytes(self) -> int:
        """Bytes one expert's packed weights + scales + zeros occupy (what a kernel reads per expert)."""
        return self.nbytes() // self.num_experts

    def to(self, device) -> W4Experts:
        moved: dict[str, Any] = {k: v.to(device) for k, v in self.tensors().items()}
        return replace(self, **moved)

    def kcontig_q(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_q, down_q) in the K-contiguous order, untiling a tiled pack (a copy)."""
        if not self.tiled:
            return self.gate_up_q, self.down_q
        from .gluon_pack import untile_q

        return untile_q(self.gate_up_q, self.config.group_gate_up), untile_q(
            self.down_q, self.config.group_down
        )

    def tiling_problem(self) -> str | None:
        """Why this pack cannot take the tiled layout (`to_tiled`), or None."""
        gg, gd = self.config.group_gate_up, self.config.group_down
        if self.scale_dtype not in (torch.float16, torch.bfloat16):
            return f"the tiled layout serves fp16/bf16 scales, not {self.scale_dtype}"
        if self.hidden % gg or self.inter % gd or self.inter % 16 or self.hidden % 16 or min(gg, gd) < 64:
            return (
                f"the tiled layout needs whole groups and 16-row tiles: H={self.hidden} I={self.inter} "
                f"groups {gg}/{gd} (>= 64)"
            )
        return None

    def to_tiled(self) -> W4Experts:
        """The same pack with q in the Gluon kernels' order (no padding: H and I whole groups, 2I and
        H whole 16-row tiles) and each group's scale and zero packed as one word per row (+ 4 bytes per
        row and group: 0.89 GiB at the real shape). The K-contiguous bytes are not kept: drop this pack
        to free them. fp16/bf16 scales only."""
        if self.tiled:
            return self
        from .gluon_pack import pack_scale_zero, tile_q

        problem = self.tiling_problem()
        if problem:
            raise ValueError(problem)
        gg, gd = self.config.group_gate_up, self.config.group_down
        out = replace(
            self,
            gate_up_q=tile_q(self.gate_up_q, gg),
            down_q=tile_q(self.down_q, gd),
            tiled=True,
            gate_up_sz=pack_scale_zero(self.gate_up_scale, self.gate_up_zero),
            down_sz=pack_scale_zero(self.down_scale, self.down_zero),
        )
        out.validate()
        return out

    def validate(self) -> None:
        E, H, I = self.num_experts, self.hidden, self.inter
        gg, gd = self.config.group_gate_up, self.config.group_down
        hp, ip = _round_up(H, gg), _round_up(I, gd)
        if self.tiled:
            assert self.gate_up_sz is not None and self.down_sz is not None
            assert self.gate_up_sz.shape == self.gate_up_scale.shape and self.gate_up_sz.dtype == torch.int32
            assert self.down_sz.shape == self.down_scale.shape and self.down_sz.dtype == torch.int32
            assert self.gate_up_q.shape == (E, 2 * I // 16, hp // gg, 2 * gg), self.gate_up_q.shape
            assert self.down_q.shape == (E, H // 16, ip // gd, 2 * gd) and self.down_q.dtype == torch.int32
        else:
            assert self.gate_up_q.shape == (E, 2 * I, hp // 2) and self.gate_up_q.dtype == torch.uint8
            assert self.down_q.shape == (E, H, ip // 2) and self.down_q.dtype == torch.uint8
        assert self.gate_up_scale.shape == (E, hp // gg, 2 * I) == self.gate_up_zero.shape
        assert self.down_scale.shape == (E, ip // gd, H) == self.down_zero.shape
        for t in self.tensors().values():
            assert t.is_contiguous() and t.device == self.device


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def quantize_w4(w: torch.Tensor, group: int, scale_dtype: torch.dtype, chunk: int = 8):
    """w [E, N, K] float -> (q [E, N, Kp/2] uint8, scale [E, Kp/G, N], zero [E, Kp/G, N]).

    Works `chunk` experts at a time so packing a 1 GB BF16 tensor on the GPU needs only a few
    hundred MB of fp32 scratch.
    """
    assert w.dim() == 3
    E, N, K = w.shape
    kp = _round_up(K, group)
    ng = kp // group
    q_out = torch.empty(E, N, kp // 2, dtype=torch.uint8, device=w.device)
    s_out = torch.empty(E, ng, N, dtype=scale_dtype, device=w.device)
    z_out = torch.empty(E, ng, N, dtype=scale_dtype, device=w.device)
    for e0 in range(0, E, chunk):
        wc = w[e0 : e0 + chunk].float()
        if kp != K:
            wc = torch.nn.functional.pad(wc, (0, kp - K))
        wg = wc.view(wc.shape[0], N, ng, group)  # [e, N, ng, G]
        lo = wg.amin(-1).clamp(max=0.0)
        hi = wg.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).to(scale_dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
        half = group // 2
        byte = q[..., :half] | (q[..., half:] << 4)  # [e, N, ng, G/2]
        q_out[e0 : e0 + chunk] = byte.reshape(wc.shape[0], N, kp // 2)
        s_out[e0 : e0 + chunk] = scale.transpose(1, 2).to(scale_dtype)
        z_out[e0 : e0 + chunk] = zero.transpose(1, 2).to(scale_dtype)
    return q_out, s_out, z_out


def dequantize_w4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of `quantize_w4`: -> w [E, N, K] in `dtype` (default: the scale dtype).

    Each weight is rounded once, (q - zero) * scale computed in fp32 then cast (what a W4 kernel that
    dequantises tiles in registers sees, up to where it applies the scale).
    """
    E, N, kp2 = q.shape
    ng = scale.shape[1]
    group = 2 * kp2 // ng
    half = group // 2
    b = q.view(E, N, ng, half)
    vals = torch.cat([(b & 0xF).float(), (b >> 4).float()], dim=3)  # [E, N, ng, G]
    sz = lambda t: t.float().transpose(1, 2)[..., None]  # [E, ng, N] -> [E, N, ng, 1]
    w = ((vals - sz(zero)) * sz(scale)).reshape(E, N, ng * group)[:, :, :k].contiguous()
    return w.to(dtype or scale.dtype)


def pack_w4(gate_up: torch.Tensor, down: torch.Tensor, config: W4Config | None = None) -> W4Experts:
    """HF experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> W4Experts on the same device."""
    config = config or W4Config()
    assert gate_up.dim() == 3 and down.dim() == 3
    E, two_i, H = gate_up.shape
    I = two_i // 2
    assert two_i == 2 * I and down.shape == (E, H, I), (gate_up.shape, down.shape)
    sdt = config.scale_dtype or gate_up.dtype
    assert sdt in (torch.float16, torch.bfloat16, torch.float32)
    gq, gs, gz = quantize_w4(gate_up.detach(), config.group_gate_up, sdt)
    dq, ds, dz = quantize_w4(down.detach(), config.group_down, sdt)
    packed = W4Experts(gq, gs, gz, dq, ds, dz, hidden=H, inter=I, config=config)
    packed.validate()
    return packed


def unpack_w4(packed: W4Experts, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W4Experts -> dequantised (gate_up [E, 2I, H], down [E, H, I]) in `dtype` (default scale dtype)."""
    gq, dq = packed.kcontig_q()
    gu = dequantize_w4(gq, packed.gate_up_scale, packed.gate_up_zero, packed.hidden, dtype)
    dn = dequantize_w4(dq, packed.down_scale, packed.down_zero, packed.inter, dtype)
    return gu, dn


def max_abs_error_bound(packed: W4Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element error bound of pack/unpack, shaped like the HF weights: half a step, plus the
    clamp at level 15 when the scale was rounded down to 16 bits (15 steps x unit roundoff u)."""
    u = torch.finfo(packed.scale_dtype).eps / 2
    factor = 0.5 + 16 * u
    gg, gd = packed.config.group_gate_up, packed.config.group_down
    sg = packed.gate_up_scale.float().repeat_interleave(gg, dim=1)[:, : packed.hidden].transpose(1, 2)
    sd = packed.down_scale.float().repeat_interleave(gd, dim=1)[:, : packed.inter].transpose(1, 2)
    return factor * sg, factor * sd


def bf16_bytes(num_experts: int, hidden: int, inter: int) -> int:
    return num_experts * 3 * hidden * inter * 2


def packed_bytes(
    num_experts: int, hidden: int, inter: int, config: W4Config | None = None, scale_bytes: int = 2
) -> int:
    """Bytes of one packed layer without building it (for the 30-layer memory report)."""
    c = config or W4Config()
    hp, ip = _round_up(hidden, c.group_gate_up), _round_up(inter, c.group_down)
    gate_up = hp // 2 * 2 * inter + 2 * (hp // c.group_gate_up) * 2 * inter * scale_bytes
    down = ip // 2 * hidden + 2 * (ip // c.group_down) * hidden * scale_bytes
    return num_experts * (gate_up + down)
