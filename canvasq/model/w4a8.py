"""The FP8 path's experts on the W4 pack's own weights (W4A8, CANVASQ_FP8_GROUPED=w4a8): `fp8_moe`'s
e4m3 rows against the pack's nibbles through `kernels.moe.w4a8`, instead of an e4m3 copy of the pack.

At a 4 x 256 forward an expert holds about 64 rows, so its two GEMMs are bound by the weights' bytes:
the pack is about half the e4m3 copy's (412 against 761 MB a layer at the real shape), and the copy
is not made at all. The values are the pack's exactly (the e4m3 copy rounds the dequantised pack
once more). The rows are quantised as on the FP8 path, with each row's sums over the pack's groups
beside them (the kernel's bias form: the zero applied once per group and row).

Off the kernel path the twin is `FP8Experts`' on the pack dequantised to fp32 (unit channel scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from canvasq.model.fp8 import FP8Experts


@dataclass
class W4A8Experts:
    """One layer's W4 pack in the K-contiguous order `kernels.moe.w4a8` reads, with its tiling."""

    gate_up_q: torch.Tensor  # [E, 2I, H/2] uint8
    gate_up_scale: torch.Tensor  # [E, H/Gg, 2I]
    gate_up_zero: torch.Tensor
    down_q: torch.Tensor  # [E, H, I/2] uint8
    down_scale: torch.Tensor  # [E, I/Gd, H]
    down_zero: torch.Tensor
    copied: int = 0  # bytes made here (the untiled q of a tiled pack); the rest is the pack's
    block_m: int = 64
    block_n: int = 128
    warps: int = 4
    grouped: str = "w4a8"

    @classmethod
    def from_w4(cls, packed) -> W4A8Experts:
        gq, dq = packed.kcontig_q()
        copied = 0 if gq is packed.gate_up_q else gq.numel() + dq.numel()
        return cls(
            gq, packed.gate_up_scale, packed.gate_up_zero, dq, packed.down_scale, packed.down_zero, copied
        )

    @property
    def num_experts(self) -> int:
        return self.gate_up_q.shape[0]

    def nbytes(self) -> int:
        return self.copied

    def groups(self) -> tuple[int, int]:
        """(gate/up's group along H, down's along I)."""
        hidden, inter = 2 * self.gate_up_q.shape[2], 2 * self.down_q.shape[2]
        return hidden // self.gate_up_scale.shape[1], inter // self.down_scale.shape[1]

    def rows(self, x: torch.Tensor, order, row_of, offs, kernel: bool) -> torch.Tensor:
        """`FP8Experts.rows` on the pack: tokens x [N, H] -> [N*K, H] in expert order."""
        if not kernel:
            return self.twin().rows(x, order, row_of, offs, kernel=False)
        from canvasq.kernels.fp8_quant import gelu_mul_quant_sums, quantize_rows_sums
        from canvasq.kernels.moe.w4a8 import w4a8_grouped

        g_up, g_down = self.groups()
        tiles = (self.block_m, self.block_n, self.warps)
        xq, xs, sums = quantize_rows_sums(x.contiguous(), g_up, dest=row_of)
        h = w4a8_grouped(
            xq, xs, self.gate_up_q, self.gate_up_scale, self.gate_up_zero, offs, x.dtype, *tiles, sums=sums
        )
        aq, as_, sums = gelu_mul_quant_sums(h, g_down)
        return w4a8_grouped(
            aq, as_, self.down_q, self.down_scale, self.down_zero, offs, x.dtype, *tiles, sums=sums
        )

    def twin(self) -> FP8Experts:
        """The pack dequantised to fp32 as `FP8Experts` with unit channel scales (the CPU's path)."""
        from canvasq.kernels.moe.quant import dequantize_w4

        hidden, inter = 2 * self.gate_up_q.shape[2], 2 * self.down_q.shape[2]
        gu = dequantize_w4(self.gate_up_q, self.gate_up_scale, self.gate_up_zero, hidden, torch.float32)
        dn = dequantize_w4(self.down_q, self.down_scale, self.down_zero, inter, torch.float32)
        ones = [torch.ones(w.shape[:2], device=w.device) for w in (gu, dn)]
        return FP8Experts(gu, ones[0], dn, ones[1])
