"""The W4A8 wgmma kernel (`kernels.moe.gluon_w4a8`). On CPU: its byte order (`gluon_pack.tile_q8`)
read the way the kernel's registers read it, its scale/zero words, and its compile for sm_90 (wgmma
in the main loop, no spill, the operand's layout change a renaming). On a Hopper GPU: the kernel
against the Triton W4A8 kernel and the pack dequantised, row for row."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testutil import rel_err

from canvasq.kernels.moe.gluon_pack import pack_scale_zero8, tile_q8, untile_q8
from canvasq.kernels.moe.gluon_w4a8 import SWEEP_TILES
from canvasq.kernels.moe.quant import W4Config, dequantize_w4, pack_w4
from canvasq.kernels.moe.w4a8 import W4A8Matrix, group_sums, w4a8_grouped
from canvasq.model.fp8 import _grouped, expert_order, fp8_supported, quantize_rows


@pytest.mark.parametrize("group", [64, 128])
def test_the_lanes_bytes_are_the_packs_bytes_moved(group):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (3, 48, 3 * group // 2), dtype=torch.uint8, generator=g)
    q8 = tile_q8(q, group)
    assert q8.shape == (3, 3, 3, 8 * group) and torch.equal(untile_q8(q8), q)
    hb = (
        group // 2
    )  # lane 4g + t, byte 8j + 4r + b <-> row 16T + 8r + g, byte 16j + 4t + b of the group's half
    lanes = q8.reshape(3, 3, 3, 8, 4, hb // 16, 2, 4)  # E, T, group, g, t, j, r, b
    e, tile, grp, gg, t, j, r, b = 2, 1, 2, 5, 3, 1, 1, 2
    assert lanes[e, tile, grp, gg, t, j, r, b] == q[e, 16 * tile + 8 * r + gg, grp * hb + 16 * j + 4 * t + b]


@pytest.mark.parametrize("group", [64, 128])
def test_the_kernels_register_renaming_gives_each_row_its_low_and_high_nibbles(group):
    """The main loop's `_operands` on one tile, in torch: the words as loaded ([BN/16, 32, G/16] a lane
    each), split into little-endian bytes, masked, then reshaped and permuted as the kernel does, are
    the [BN, G/2] operands of the group's first and second halves of k."""
    g = torch.Generator().manual_seed(1)
    bn, hb = 64, group // 2
    q = torch.randint(0, 256, (1, bn, 2 * hb), dtype=torch.uint8, generator=g)  # two groups
    words = tile_q8(q, group)[0, :, 1].contiguous().view(torch.int32)  # group 1, [BN/16, 8G/4]
    words = words.reshape(bn // 16, 32, hb // 8)
    for shift, half in ((0, slice(0, hb)), (4, slice(hb, 2 * hb))):
        nib = (words >> shift) & 0x0F0F0F0F
        by = torch.stack([(nib >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(bn // 16, 32, hb // 2)
        t = by.reshape(bn // 16, 8, 4, hb // 16, 2, 4).permute(0, 4, 1, 3, 2, 5).reshape(bn, hb)
        grp1 = q[0, :, hb:].to(torch.int32)  # group 1's packed bytes
        want = (grp1 >> shift) & 0xF  # low nibble: k of the first half; high: k + G/2
        assert torch.equal(t, want), half


def test_scale_zero_words_widen_to_the_bf16_values_exactly():
    g = torch.Generator().manual_seed(2)
    s = (torch.rand(2, 3, 64, generator=g) * 1e-2).bfloat16()
    z = torch.randint(0, 16, (2, 3, 64), generator=g).bfloat16()
    w = pack_scale_zero8(s, z)
    assert torch.equal((w << 16).view(torch.float32), s.float())
    assert torch.equal((w & -65536).view(torch.float32), z.float())


def test_a_wgmma_matrix_holds_the_pack_reordered_and_gives_it_back():
    packed = _pack(3, 4, 256, 128, torch.bfloat16)
    gq, _ = packed.kcontig_q()
    m = W4A8Matrix.of(gq, packed.gate_up_scale, packed.gate_up_zero, wgmma=True)
    assert m.wgmma and m.q.shape == (4, 16, 2, 1024) and m.scale.dtype == torch.int32
    q, s, z = m.unpacked()
    assert torch.equal(q, gq) and torch.equal(s, packed.gate_up_scale) and torch.equal(z, packed.gate_up_zero)
    assert not W4A8Matrix.of(gq, packed.gate_up_scale, packed.gate_up_zero).wgmma  # the CPU: Triton's


def test_it_compiles_for_sm90_with_wgmma_in_its_loop_and_no_spill():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--only", "w4a8_wgmma"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in out.stdout.splitlines() if line.startswith("{'kernel'")]
    assert json.loads(out.stdout.strip().splitlines()[-1])["kernels"] == len(rows) == 2 * len(SWEEP_TILES)
    looped = [r for r in rows if "loop_mma" in r]  # two groups an iteration, each 4 QGMMA (G 128) or 2 (G 64)
    assert looped and all(r["loop_mma"] == (8 if "gate_up" in r["kernel"] else 4) for r in looped)
    assert all(r["stack"] == 0 for r in rows)


def _pack(seed, e, h, i, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    cfg = W4Config(group_gate_up=128, group_down=64, scale_dtype=dtype)
    return pack_w4(gate_up.to(dtype), down.to(dtype), cfg).to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "tiles", [(64, 64, 4, 3, 1), (32, 64, 4, 2, 2), (64, 128, 8, 3, 1), (128, 64, 4, 4, 1), (64, 64, 4, 2, 2)]
)
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_wgmma_matches_the_triton_w4a8_and_the_dequantised_pack(which, tiles):
    if not fp8_supported("cuda") or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma: sm_90 only")
    e, h, i, tokens, top_k = 8, 512, 256, 150, 4
    packed = _pack(4, e, h, i, torch.bfloat16, "cuda")
    gq, dq = packed.kcontig_q()
    q, s, z, k = (
        (gq, packed.gate_up_scale, packed.gate_up_zero, h)
        if which == "gate_up"
        else (dq, packed.down_scale, packed.down_zero, i)
    )
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    ids[ids == 2] = 3  # an expert with no rows; the others' counts are not multiples of a tile
    _, offs, _ = expert_order(ids, e, kernel=False)
    xq, xs = quantize_rows(torch.randn(tokens * top_k, k, generator=g))
    xq, xs, offs = xq.cuda(), xs.cuda(), offs.cuda()
    sums = group_sums(xq, k // s.shape[1])
    w = dequantize_w4(q, s, z, k, torch.float32)
    want = _grouped(
        xq.float(), xs, w, torch.ones(e, w.shape[1], device="cuda"), offs, torch.float32, kernel=False
    )
    m = W4A8Matrix.of(q, s, z, wgmma=True)
    m.tiles = tiles
    got = m.gemm(xq, xs, sums, offs, torch.float32)
    triton = w4a8_grouped(xq, xs, q, s, z, offs, torch.float32, sums=sums)
    assert rel_err(got, want) < 2e-3 and rel_err(got, triton) < 2e-3  # wgmma's own e4m3 accumulator
