"""The runtime's attention kernel (`canvasq.kernels.attention`) against its twin, SDPA on gathered slots."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, rel_err

from canvasq.kernels.attention import attend, attend_launch, attend_reference

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _case(nb, kvh, g, r, d, slots_total, cap, lmax, dtype, seed=0, masked=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(nb, kvh, g * r, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(slots_total, kvh, cap, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(slots_total, kvh, cap, d, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(slots_total, generator=gen)[:nb].to(DEVICE)
    mask = None
    if masked:  # a band per row (like the sliding masks), the last row of each window sees nothing
        pos = torch.arange(lmax)
        lo = torch.randint(0, lmax // 2, (nb, 1, g * r, 1), generator=gen)
        hi = lo + torch.randint(1, lmax, (nb, 1, g * r, 1), generator=gen)
        see = (pos >= lo) & (pos < hi)
        see.view(nb, 1, g, r, lmax)[:, :, :, -1] = False
        mask = torch.zeros(see.shape).masked_fill(~see, float("-inf")).to(DEVICE, dtype)
    return q, k, v, slots, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nb,kvh,g,r,d,lmax,masked",
    [
        (1, 2, 2, 37, 64, 70, True),
        (3, 1, 4, 9, 32, 129, True),
        (2, 2, 1, 65, 128, 64, False),
        (1, 1, 2, 5, 16, 7, True),
    ],
)
def test_attend_matches_sdpa_on_gathered_slots(nb, kvh, g, r, d, lmax, masked, dtype):
    q, k, v, slots, mask = _case(nb, kvh, g, r, d, nb + 2, lmax + 5, lmax, dtype, masked=masked)
    got = attend_launch(q, k, v, slots, lmax, mask, groups=g)
    want = attend_reference(q, k, v, slots, lmax, mask, groups=g)
    assert got.shape == want.shape == (nb * r, kvh * g * d)
    assert torch.equal(got, attend(q, k, v, slots, lmax, mask, groups=g, impl="triton")), "deterministic"
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
    q, k, v, slots, mask = _case(2, 2, 2, 40, 64, 4, 150, 140, torch.float32)
    got = attend_launch(q, k, v, slots, 140, mask, groups=2, tiles=tiles)
    assert rel_err(got, attend_launch(q, k, v, slots, 140, mask, groups=2, tiles=(16, 32, 4, 2))) < 1e-5
