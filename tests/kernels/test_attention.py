"""The runtime's attention kernel (`canvasq.kernels.attention`) against its twin, SDPA on gathered slots."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, rel_err

from canvasq.kernels.attention import Bounds, attend, attend_launch, attend_reference

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _case(nb, kvh, g, r, d, slots_total, cap, lmax, dtype, seed=0, masked=True, sliding=True):
    """Arena entries in no position order (as `KVArena` allows), a ragged `ends` per window, a band per
    row (hi, and lo on sliding layers); the last row of each window is padding (hi 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(nb, kvh, g * r, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(slots_total, kvh, cap, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(slots_total, kvh, cap, d, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(slots_total, generator=gen)[:nb].to(DEVICE)
    bounds = None
    if masked:
        pos = torch.stack([torch.randperm(cap, generator=gen) for _ in range(slots_total)]).to(DEVICE)
        ends = torch.randint(lmax // 2, lmax + 1, (nb,), generator=gen).to(DEVICE)
        lo = torch.randint(0, cap // 2, (nb, r), generator=gen)
        hi = lo + torch.randint(1, cap, (nb, r), generator=gen)
        hi[:, -1] = 0
        lo, hi = lo.to(DEVICE), hi.to(DEVICE)
        bounds = Bounds.build(pos, pos[slots, :lmax], ends, hi, lo if sliding else None)
    return q, k, v, slots, bounds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nb,kvh,g,r,d,lmax,masked,sliding",
    [
        (1, 2, 2, 37, 64, 70, True, True),
        (3, 1, 4, 9, 32, 129, True, False),
        (2, 2, 1, 65, 128, 64, False, False),
        (1, 1, 2, 5, 16, 7, True, True),
    ],
)
def test_attend_matches_sdpa_on_gathered_slots(nb, kvh, g, r, d, lmax, masked, sliding, dtype):
    q, k, v, slots, bounds = _case(
        nb, kvh, g, r, d, nb + 2, lmax + 5, lmax, dtype, masked=masked, sliding=sliding
    )
    got = attend_launch(q, k, v, slots, lmax, bounds, groups=g)
    mask = bounds.mask(bounds.pos[slots, :lmax], g, dtype) if masked else None
    want = attend_reference(q, k, v, slots, lmax, mask, groups=g)
    assert got.shape == want.shape == (nb * r, kvh * g * d)
    assert torch.equal(got, attend(q, k, v, slots, lmax, bounds=bounds, groups=g, impl="triton")), (
        "deterministic"
    )
    # per (row, head): a query that sees no key gives zeros here (NaN in SDPA); the rest match SDPA
    per_head = lambda t: t.view(nb, r, kvh, g, d).reshape(nb * r * kvh * g, d)
    if masked:
        blind = (
            torch.isinf(mask).all(-1).view(nb, 1, g, r).expand(nb, kvh, g, r).permute(0, 3, 1, 2).reshape(-1)
        )
        assert blind.any() and not blind.all()
    else:
        blind = torch.zeros(nb * r * kvh * g, dtype=torch.bool, device=got.device)
    assert torch.equal(per_head(got)[blind], torch.zeros_like(per_head(got)[blind]))
    seen_got, seen_want = per_head(got)[~blind], per_head(want)[~blind]
    assert torch.isfinite(seen_got).all()
    assert rel_err(seen_got, seen_want) < TOL[dtype]


def test_attend_visits_only_the_entries_its_bounds_allow():
    """A sliding window of positions over an arena in position order: the kernel reads only the entries
    between `Bounds.first` and `last` (everything else poisoned with NaN) and gives SDPA's answer."""
    nb, kvh, g, r, d, cap, lmax = 2, 1, 2, 8, 32, 200, 180
    q, k, v, slots, _ = _case(nb, kvh, g, r, d, 3, cap, lmax, torch.float32, masked=False)
    pos = torch.arange(cap, device=DEVICE).repeat(3, 1)
    ends = torch.tensor([lmax, 120], device=DEVICE)
    hi = torch.tensor([[170] * r, [110] * r], device=DEVICE)  # one canvas's rows, its end
    lo = hi - torch.tensor([40, 64], device=DEVICE)[:, None] - torch.arange(r, device=DEVICE)
    bounds = Bounds.build(pos, pos[slots, :lmax], ends, hi, lo)
    assert bounds.first.tolist() == [170 - 40 - r + 1, 110 - 64 - r + 1] and bounds.last.tolist() == [
        170,
        110,
    ]
    k2, v2 = k.clone(), v.clone()
    for b, s in enumerate(slots.tolist()):
        for t in (k2, v2):
            t[s, :, : int(bounds.first[b]) // 32 * 32] = float("nan")  # before the first tile read
            t[s, :, int(bounds.last[b]) :] = float("nan")
    got = attend_launch(q, k2, v2, slots, lmax, bounds, groups=g)
    want = attend_reference(q, k, v, slots, lmax, bounds.mask(pos[slots, :lmax], g, q.dtype), groups=g)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-4


def test_attend_reads_only_the_named_slots_and_entries():
    """Entries past lmax and other slots' entries never reach the output (poisoned with NaN)."""
    q, k, v, slots, _ = _case(2, 2, 2, 8, 32, 5, 40, 24, torch.float32, masked=False)
    k2, v2 = k.clone(), v.clone()
    other = torch.ones(5, dtype=torch.bool)
    other[slots.cpu()] = False
    for t in (k2, v2):
        t[:, :, 24:] = float("nan")
        t[other.to(DEVICE)] = float("nan")
    got = attend_launch(q, k2, v2, slots, 24, None, groups=2)
    assert torch.isfinite(got).all()
    assert torch.equal(got, attend_launch(q, k, v, slots, 24, None, groups=2))


@pytest.mark.parametrize("tiles", [(64, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2)])
def test_attend_tiles_agree(tiles):
    """The tiles the H200 probe compared give the same result up to summation order."""
    q, k, v, slots, bounds = _case(2, 2, 2, 40, 64, 4, 150, 140, torch.float32)
    got = attend_launch(q, k, v, slots, 140, bounds, groups=2, tiles=tiles)
    assert rel_err(got, attend_launch(q, k, v, slots, 140, bounds, groups=2, tiles=(16, 32, 4, 2))) < 1e-5


@torch.no_grad()
def test_runtime_windows_through_the_kernel_match_sdpa(monkeypatch):
    """The runtime's attention geometry through the kernel (`kernel_rows` above every window: bounds
    from the stored positions) against SDPA with its masks (`kernel_rows` 0), toy model, fp32: ragged
    prompts (padded encoder blocks), a prompt longer than the sliding window, one canvas, two
    block-causal canvases (pipe), a window whose leading rows are a folded encoder pass, slots out of
    order."""
    import canvasq.kernels.attention as attention_module
    from canvasq.model.runtime import Runtime, Window
    from tests.model.model_helpers import random_model, small_shape

    if DEVICE != "cpu":
        pytest.skip("interpreter test (CPU tensors); the CUDA path: tests/model/test_model_gpu.py")
    calls = []
    real_launch = attention_module.attend_launch
    monkeypatch.setattr(
        attention_module, "attend_launch", lambda *a, **k: calls.append(1) or real_launch(*a, **k)
    )
    shape = small_shape()
    m = random_model(shape)
    c, v = shape.canvas_length, shape.vocab_size
    gen = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(5, v, (n,), generator=gen)
    prompts = {3: ids(30), 0: ids(5), 2: ids(19)}  # slot 3's prompt is longer than the window (16)
    enc, can = ids(c), ids(c)
    fold_pos = torch.arange(30, 30 + 2 * c)
    windows = [
        Window.canvas(2, ids(c), 19),
        Window.blocks(0, [(ids(c), 5), (ids(c), 5 + c)]),
        Window(  # slot 3: its last canvas committed by the encoder rows riding in this forward
            3,
            torch.cat([enc, can]),
            fold_pos,
            torch.cat([fold_pos[:c], torch.full((c,), 30 + c)]),
            torch.cat([fold_pos[:c] + 1, torch.full((c,), 30 + 2 * c)]),
            encoder_rows=c,
        ),
    ]

    def logits(kernel_rows: int) -> torch.Tensor:
        rt = Runtime.from_hf(m, kernels=True)
        rt.kernel_rows = kernel_rows
        arena = rt.new_arena(4, 96)
        rt.encode_many(arena, [(s, p, torch.arange(p.numel())) for s, p in prompts.items()])
        return rt.decode(arena, windows).logits

    want = logits(0)
    assert not calls
    got = logits(10**6)
    assert calls, "the kernel ran"
    assert got.shape == want.shape and rel_err(got, want) < 1e-4


def test_tiles_fit_the_device_and_take_the_runtime_knob():
    """The table's fastest tile where its shared memory fits, a smaller one on a ~100 KB device (DGX
    Spark), and `Runtime.attention_tiles` before either; every table tile's estimate is what it stages."""
    from canvasq.kernels.attention import TILES, _tiles, tile_smem

    assert _tiles(256, 232_448) == TILES[256][0] and tile_smem(256, TILES[256][0]) == 98_304
    assert _tiles(512, 232_448) == TILES[512][0]
    spark = 101_376
    assert all(tile_smem(d, _tiles(d, spark)) <= spark for d in (256, 512))
    assert _tiles(256, spark, "256:16x32x4x2/512:64x32x8x2") == (16, 32, 4, 2)
    assert _tiles(512, None, "256:16x32x4x2/512:64x32x8x2") == (64, 32, 8, 2)
    assert _tiles(64, None) == (32, 32, 4, 2)
