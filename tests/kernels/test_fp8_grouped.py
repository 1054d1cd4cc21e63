"""Our grouped GEMM over rows in expert order (`kernels.fp8_grouped`) against the dequantising twin
(`model.fp8._grouped`'s CPU path) and, on Hopper, against torch's `_scaled_grouped_mm` and through the
FP8 expert layer."""

import dataclasses

import pytest
import torch
from kernel_testutil import DEVICE, ON_GPU, poison, rel_err

from canvasq.kernels.fp8_grouped import grouped_gemm
from canvasq.kernels.fp8_grouped_tiles import Tiles, tiles_for
from canvasq.model.fp8 import _grouped, expert_order, quantize_rows

# fp32 operands: exact products on the CPU, TF32 (tl.dot's default) on a GPU
TOL = {torch.float32: 2e-3 if ON_GPU else 1e-5, torch.float16: 2e-3}


def _case(experts, n, k, tokens, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[: tokens // 3] = torch.arange(top_k)  # a hot expert run longer than one tile
    ids[ids == experts - 2] = experts - 1  # and an expert with no rows
    _, offs, _ = expert_order(ids, experts, kernel=False)
    m = tokens * top_k
    a = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(experts, n, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    a_s = (torch.rand(m, generator=g) + 0.5).to(DEVICE)
    w_s = (torch.rand(experts, n, generator=g) + 0.5).to(DEVICE)
    return a, a_s, w, w_s, offs.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tiles,n,k",
    [
        (Tiles(16, 16, 32, stages=1), 48, 96),  # K a multiple of the block
        (Tiles(16, 32, 64, stages=1), 40, 80),  # K and N past their last block
        (Tiles(16, 16, 32, stages=1, tma=True), 48, 96),  # descriptors: the weights as one matrix
        (Tiles(16, 32, 64, stages=1, tma=True), 40, 80),  # a column tile reading the next expert's rows
        (Tiles(16, 32, 64, stages=1, m_major=True), 40, 80),  # row tiles outer: every tile still once
        (Tiles(16, 32, 64, stages=1, persistent=1), 40, 80),  # 3 programs, each looping over tiles
        (Tiles(16, 16, 32, stages=1, tma=True, m_major=True, persistent=2), 48, 96),
    ],
)
def test_grouped_gemm_matches_the_twin_row_for_row(dtype, tiles, n, k):
    a, a_s, w, w_s, offs = _case(8, n, k, 20, 2, dtype)
    assert int(torch.diff(offs, prepend=offs.new_zeros(1)).min()) == 0  # the case holds an empty expert
    want = _grouped(a.float(), a_s, w.float(), w_s, offs.cpu(), torch.float32, kernel=False)
    got = grouped_gemm(a, a_s, w, w_s, offs, torch.float32, tiles)
    assert not got.isnan().any()  # every row of every expert written
    assert rel_err(got.cpu(), want.cpu()) < TOL[dtype]


@pytest.mark.parametrize("tma", [False, True])
def test_the_gated_epilogue_gives_gelu_mul_of_the_gate_up_rows(tma):
    """gated=True: W's gate | up rows in one launch, out gelu_tanh(gate) * up ([M, I]), what
    `gelu_mul` gives on the [M, 2I] output the plain launch writes."""
    from canvasq.kernels.gelu_mul import gelu_mul_reference

    inter = 40  # 40 = 2.5 column tiles of 16: the last gate tile reads into the up rows
    a, a_s, w, w_s, offs = _case(8, 2 * inter, 64, 20, 2, torch.float32)
    gu = grouped_gemm(a, a_s, w, w_s, offs, torch.float32, Tiles(16, 16, 32, stages=1))
    got = grouped_gemm(a, a_s, w, w_s, offs, torch.float32, Tiles(16, 16, 32, stages=1, tma=tma), gated=True)
    assert got.shape == (a.shape[0], inter)
    assert rel_err(got.cpu(), gelu_mul_reference(gu).cpu()) < TOL[torch.float32]


def test_rows_past_the_last_expert_are_left_alone():
    """offs[-1] < M: the rows past it belong to no expert and the launch writes none of them."""
    a, a_s, w, w_s, offs = _case(4, 16, 32, 6, 2, torch.float32)
    short = offs.clone()
    short[-1] -= 3  # the last expert's last three rows are not its own
    end = int(short[-1])
    out = poison((a.shape[0], 16), torch.float32)
    grouped_gemm(a, a_s, w, w_s, short, torch.float32, Tiles(16, 16, 32, stages=1), out=out)
    assert out[end:].isnan().all()
    want = _grouped(a.float(), a_s, w.float(), w_s, short.cpu(), torch.float32, kernel=False)
    assert rel_err(out[:end].cpu(), want[:end].cpu()) < TOL[torch.float32]


@pytest.mark.parametrize("tma,m_major", [(False, False), (True, True)])
@pytest.mark.parametrize("gated", [False, True])
def test_a_persistent_launch_writes_the_one_tile_launchs_bytes(tma, m_major, gated):
    """Programs that loop over the live tiles compute each tile as a program of its own does: the same
    bytes, every row of every expert written, the rows past the last expert left alone."""
    a, a_s, w, w_s, offs = _case(8, 80, 64, 20, 2, torch.float32)
    short = offs.clone()
    short[-1] -= 3
    outs = []
    for persistent in (0, 1, 2):
        out = poison((a.shape[0], 40 if gated else 80), torch.float32)
        t = Tiles(16, 16, 32, stages=1, tma=tma, m_major=m_major, persistent=persistent)
        outs.append(grouped_gemm(a, a_s, w, w_s, short, torch.float32, t, out=out, gated=gated))
    end = int(short[-1])
    assert not outs[0][:end].isnan().any() and outs[0][end:].isnan().all()
    for got in outs[1:]:
        assert torch.equal(got[:end], outs[0][:end]) and got[end:].isnan().all()


def test_the_untuned_tiling_follows_the_rows_an_expert_holds():
    assert tiles_for(1024 * 8, 128, device="untuned").block_m == 64  # 64 rows an expert: the weights' bytes
    assert tiles_for(4096 * 8, 128, device="untuned").block_m == 128


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="e4m3 tensor cores: Hopper")
@pytest.mark.parametrize("tokens", [5, 300, 1024])
def test_grouped_gemm_matches_torchs_scaled_grouped_mm_in_e4m3(tokens):
    from canvasq.model.fp8 import fp8_supported

    if not fp8_supported(DEVICE):
        pytest.skip("no FP8 grouped GEMM in torch on this GPU")
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    for n, k in ((1408, 2816), (2816, 704)):
        ids = torch.rand(tokens, 128, generator=g, device=DEVICE).topk(8, dim=1).indices
        _, offs, _ = expert_order(ids, 128, kernel=True)
        aq, a_s = quantize_rows(torch.randn(tokens * 8, k, generator=g, device=DEVICE, dtype=torch.bfloat16))
        wq, w_s = quantize_rows(torch.randn(128, n, k, generator=g, device=DEVICE, dtype=torch.bfloat16))
        want = _grouped(aq, a_s, wq, w_s, offs, torch.bfloat16, kernel=True)
        for tiles in (
            None,
            Tiles(64, 128, 128),
            Tiles(128, 128, 128, warps=8),
            Tiles(64, 128, 128, tma=True),
            Tiles(64, 128, 128, tma=True, m_major=True, persistent=1),
            Tiles(128, 128, 128, warps=8, m_major=True, persistent=2),
        ):
            got = grouped_gemm(aq, a_s, wq, w_s, offs, torch.bfloat16, tiles)
            assert rel_err(got, want) < 1e-2, (n, k, tiles)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="e4m3 tensor cores: Hopper")
def test_the_fp8_expert_layer_gives_the_same_rows_through_either_grouped_gemm():
    from canvasq.model.fp8 import FP8Experts, fp8_moe, fp8_supported

    if not fp8_supported(DEVICE):
        pytest.skip("no FP8 grouped GEMM in torch on this GPU")
    g = torch.Generator(device=DEVICE).manual_seed(3)
    e, h, i, n = 16, 256, 128, 300
    ex = FP8Experts.from_weights(
        torch.randn(e, 2 * i, h, generator=g, device=DEVICE, dtype=torch.bfloat16) * 0.05,
        torch.randn(e, h, i, generator=g, device=DEVICE, dtype=torch.bfloat16) * 0.05,
    )
    x = torch.randn(n, h, generator=g, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.rand(n, e, generator=g, device=DEVICE).topk(4, dim=1).indices
    p = torch.rand(n, 4, generator=g, device=DEVICE)
    ours = fp8_moe(x, ids, p, dataclasses.replace(ex, grouped="triton"))
    assert rel_err(ours, fp8_moe(x, ids, p, ex)) < 1e-2


def test_a_tuned_file_gives_the_tiling_at_the_nearest_row_count_at_or_above(tmp_path, monkeypatch):
    from canvasq.kernels.fp8_grouped_tiles import TUNED_ENV, gemm_key, save_tuned

    small, large = Tiles(64, 64, 128, tma=True), Tiles(128, 128, 128, warps=8, stages=3)
    path = tmp_path / "tuned.json"
    save_tuned(path, {gemm_key(2816, 704, False): {8192: small, 32768: large}}, {"device": "test"})
    monkeypatch.setenv(TUNED_ENV, str(path))
    assert tiles_for(100, 128, 2816, 704) == small
    assert tiles_for(8193, 128, 2816, 704) == large
    assert tiles_for(10**6, 128, 2816, 704) == large  # past the largest: the largest
    assert tiles_for(100, 128, 1408, 2816, gated=True).block_n == 64  # another GEMM: the rule's


def test_auto_takes_ours_only_on_a_gpu_with_a_tuned_file_for_it():
    from canvasq.kernels.fp8_grouped_tiles import tuned_file
    from canvasq.kernels.moe.config import device_name
    from canvasq.model.fp8 import fp8_supported, parse_grouped

    assert parse_grouped("auto", "cpu") == "torch"  # no e4m3 grouped GEMM here at all
    assert tuned_file(128, "NVIDIA_H100_80GB_HBM3").is_file()  # measured faster there (BENCHMARKS)
    assert parse_grouped("torch", "cpu") == "torch" and parse_grouped(" Triton ") == "triton"
    if ON_GPU and fp8_supported(DEVICE):
        dev = torch.device(DEVICE)
        ours = tuned_file(128, device_name(dev)).is_file()
        assert parse_grouped("auto", dev, 128) == ("triton" if ours else "torch")
        assert parse_grouped("auto", dev, 7) == "torch"  # no file for a model of 7 experts
