"""The W4A8 prototype (`kernels.moe.w4a8`) against the W4 pack dequantised and the FP8 path's twin,
row for row (the interpreter on CPU, with fp16 standing for e4m3: the same values)."""

import pytest
import torch
from kernel_testutil import DEVICE, ON_GPU, rel_err

from canvasq.kernels.moe.quant import W4Config, dequantize_w4, pack_w4
from canvasq.kernels.moe.w4a8 import group_sums, w4a8_grouped
from canvasq.model.fp8 import _grouped, expert_order, quantize_rows


def test_a_nibble_byte_read_as_e4m3_is_the_nibble_times_2_to_the_minus_9():
    nibbles = torch.arange(16, dtype=torch.uint8)  # the bias form's weights: no conversion
    assert torch.equal(nibbles.view(torch.float8_e4m3fn).float() * 512, nibbles.float())


@pytest.mark.parametrize("m_major", [False, True], ids=["n_outer", "m_outer"])
@pytest.mark.parametrize("bias", [False, True], ids=["converted", "bias"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_w4a8_matches_the_dequantised_pack_row_for_row(which, bias, m_major):
    g = torch.Generator().manual_seed(1)
    e, h, i, tokens, top_k = 4, 128, 64, 12, 2
    packed = pack_w4(
        torch.randn(e, 2 * i, h, generator=g) * 0.1,
        torch.randn(e, h, i, generator=g) * 0.1,
        W4Config(group_gate_up=64, group_down=64),
    )
    gq, dq = packed.kcontig_q()
    q, s, z, k = (
        (gq, packed.gate_up_scale, packed.gate_up_zero, h)
        if which == "gate_up"
        else (dq, packed.down_scale, packed.down_zero, i)
    )
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    ids[ids == 2] = 3  # an expert with no rows
    _, offs, _ = expert_order(ids, e, kernel=False)
    xq, xs = quantize_rows(torch.randn(tokens * top_k, k, generator=g))  # e4m3 values and row scales
    w = dequantize_w4(q, s, z, k, torch.float32)
    want = _grouped(xq.float(), xs, w, torch.ones(e, w.shape[1]), offs, torch.float32, kernel=False)
    x = xq if ON_GPU else xq.to(torch.float16)  # the interpreter's dot: fp16 holds e4m3's values
    got = w4a8_grouped(
        x.to(DEVICE), xs.to(DEVICE), q.to(DEVICE), s.to(DEVICE), z.to(DEVICE), offs.to(DEVICE),
        torch.float32, block_m=16, block_n=32, stages=1,
        sums=group_sums(x, k // s.shape[1]).to(DEVICE) if bias else None, m_major=m_major,
    )  # fmt: skip
    assert rel_err(got.cpu(), want) < (
        2e-3 if ON_GPU else 1e-5
    )  # wgmma sums e4m3 products in its own accumulator
