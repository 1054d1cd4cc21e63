"""Self-conditioning's top-k expected embedding in one launch against torch's weighted embedding bag."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, rel_err

from canvasq.kernels.soft_embed import soft_embed, soft_embed_launch, soft_embed_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,vocab,width", [(1, 64, 500, 128), (9, 64, 1000, 300), (5, 7, 50, 129)])
def test_soft_embed_parity(rows, k, vocab, width, dtype):
    # its own generator: drawn from the global one, some orders of the suite gave a row whose weight sat
    # in its repeated half, where the rolled weights below change little
    gen = torch.Generator().manual_seed(rows * 7 + k)
    table = torch.randn(vocab, width, generator=gen).to(DEVICE, dtype)
    ids = torch.randint(0, vocab, (rows, k), generator=gen).to(DEVICE)
    ids[0, : k // 2] = ids[0, 0]  # a repeated id counts once per occurrence
    p = torch.softmax(torch.randn(rows, k, generator=gen) * 3, dim=-1).to(DEVICE, dtype)
    out = soft_embed_launch(ids, p, table)
    want = soft_embed_reference(ids, p, table)
    assert out.shape == (rows, width) and out.dtype == dtype
    assert rel_err(out, want) < TOL[dtype]
    # every weight and every id matters: another row's weights, or ids shifted by one, give another result
    assert rel_err(out, soft_embed_reference(ids, p.roll(1, dims=1), table)) > 0.05
    assert rel_err(out, soft_embed_reference((ids + 1) % vocab, p, table)) > 0.05


def test_soft_embed_impls():
    table = torch.randn(40, 16, device=DEVICE)
    ids, p = torch.randint(0, 40, (3, 4), device=DEVICE), torch.rand(3, 4, device=DEVICE)
    assert torch.equal(soft_embed(ids, p, table), soft_embed_reference(ids, p, table))  # torch by default
    assert rel_err(soft_embed(ids, p, table, impl="triton"), soft_embed_reference(ids, p, table)) < 1e-5
    assert soft_embed_launch(ids[:0], p[:0], table).shape == (0, 16)
    with pytest.raises(ValueError, match="unknown impl"):
        soft_embed(ids, p, table, impl="nope")
