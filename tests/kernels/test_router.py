"""The router's softmax + top-k in one launch against the twin (torch softmax fp32, then torch.topk)."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES

from canvasq.kernels.router import router_topk, router_topk_launch, router_topk_reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,e,k", [(1, 8, 2), (37, 128, 8), (9, 100, 5), (300, 128, 8), (4, 16, 16)])
def test_router_topk_matches_torch(n, e, k, dtype):
    g = torch.Generator().manual_seed(n + e + k)
    logits = (torch.randn(n, e, generator=g) * 3).to(dtype).to(DEVICE)
    p, ids = router_topk_launch(logits, k)
    want_p, want_ids = router_topk_reference(logits, k)
    assert p.dtype == torch.float32 and ids.dtype == torch.int64 and p.shape == ids.shape == (n, k)
    torch.testing.assert_close(p, want_p, rtol=2e-6, atol=1e-7)
    assert (p[:, :-1] >= p[:, 1:]).all()  # descending, like torch.topk
    # the same experts; where 16-bit logits tie, torch may order (or cut) the tied ones differently,
    # so compare the probabilities the ids select, and the ids themselves on rows without ties
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    torch.testing.assert_close(probs.gather(1, ids), want_p, rtol=2e-6, atol=1e-7)
    assert len(set(ids[0].tolist())) == k
    untied = torch.tensor([len(set(r.tolist())) == e for r in logits.float().cpu()], device=DEVICE)
    assert torch.equal(ids[untied], want_ids[untied])
    assert untied.float().mean() > 0.5 or dtype != torch.float32


def test_router_topk_ties_padding_and_strides():
    # equal logits: the lower expert id first
    logits = torch.zeros(3, 12, device=DEVICE)
    logits[:, 7] = 1.0
    p, ids = router_topk_launch(logits, 4)
    assert ids.tolist() == [[7, 0, 1, 2]] * 3
    assert torch.allclose(p.sum(1) + 8 * p[:, 1], torch.ones(3, device=DEVICE), atol=1e-6)
    # a column slice of a wider matrix (rows with a larger stride), and -inf logits never chosen
    wide = torch.randn(6, 40, device=DEVICE)
    wide[:, 3] = float("-inf")
    sl = wide[:, :24]
    p, ids = router_topk(sl, 23, impl="triton")
    want_p, want_ids = router_topk_reference(sl, 23)
    assert torch.equal(ids, want_ids) and (ids != 3).all()
    torch.testing.assert_close(p, want_p, rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="unknown impl"):
        router_topk(sl, 2, impl="nope")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_topk_ties_pick_the_experts_cuda_topk_picks():
    """bf16 router logits tie often (128 experts, 8 mantissa bits): where a tie straddles the k-th
    place, CUDA's torch.topk (HF's router on a GPU) keeps the lower expert ids, and so must we."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4096, 128, generator=g) * 2).round().to(torch.bfloat16).cuda()  # many ties
    p, ids = router_topk_launch(logits, 8)
    want_p, want_ids = router_topk_reference(logits, 8)
    torch.testing.assert_close(p, want_p, rtol=2e-6, atol=1e-7)
    assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)


def test_pdl_only_for_compiled_kernels_on_hopper(monkeypatch):
    """Programmatic dependent launch is asked for only where it exists (compiled, CUDA, sm_90+) and can
    be switched off; on a GPU the kernels give the same bits either way."""
    from canvasq.kernels._dispatch import pdl
    from canvasq.kernels.router import _router_topk_kernel

    cpu = torch.zeros(2, 8)
    assert not pdl(cpu, _router_topk_kernel)
    if not torch.cuda.is_available():
        return
    logits = torch.randn(300, 128, device="cuda").to(torch.bfloat16)
    on = router_topk_launch(logits, 8)
    assert pdl(logits, _router_topk_kernel) == (torch.cuda.get_device_capability() >= (9, 0))
    monkeypatch.setenv("CANVASQ_PDL", "off")
    assert not pdl(logits, _router_topk_kernel)
    off = router_topk_launch(logits, 8)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
