"""Fused softmax confidence + argmax + entropy vs the materialising torch path."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU

from canvasq.kernels.softmax_argmax import (
    softmax_argmax,
    softmax_argmax_launch,
    softmax_argmax_reference,
    softmax_sample,
)


def _logits(R, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, V, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,V", [(1, 1000), (3, 5003), (17, 4096), (2, 40000)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_parity(R, V, dtype, temperature):
    logits = _logits(R, V, dtype, seed=R * V)
    conf, arg, ent = softmax_argmax_launch(logits, temperature)
    c2, a2, e2 = softmax_argmax_reference(logits, temperature)
    assert torch.equal(arg, a2)
    assert ((conf - c2).abs() / c2).max() < 1e-4
    assert (ent - e2).abs().max() < 1e-4 * max(1.0, e2.abs().max().item())
    again = softmax_argmax_launch(logits, temperature)
    assert all(torch.equal(a, b) for a, b in zip((conf, arg, ent), again)), "deterministic"


def test_ties_masks_and_peaks():
    logits = _logits(4, 3000, torch.float32, seed=1)
    logits[0, 17] = logits[0, 2500] = 50.0  # tie: first index wins, as torch.argmax
    logits[1, :2990] = float("-inf")  # masked vocabulary
    logits[2] = 0.0  # uniform: entropy log V, confidence 1/V
    logits[3, 1234] = 1e4  # one-hot: confidence 1, entropy 0
    conf, arg, ent = softmax_argmax(logits, impl="triton")
    c2, a2, e2 = softmax_argmax_reference(logits)
    assert arg.tolist()[0] == 17 and torch.equal(arg, a2)
    assert torch.allclose(conf, c2, rtol=1e-5) and torch.allclose(ent, e2, atol=1e-5)
    assert abs(ent[2].item() - torch.log(torch.tensor(3000.0)).item()) < 1e-4
    assert conf[3].item() == 1.0 and abs(ent[3].item()) < 1e-6
    assert torch.isfinite(ent).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_real_vocab_bf16():
    logits = _logits(256, 262144, torch.bfloat16, seed=0)
    conf, arg, ent = softmax_argmax(logits)
    c2, a2, e2 = softmax_argmax_reference(logits)
    assert torch.equal(arg, a2) and ((conf - c2).abs() / c2).max() < 1e-3 and (ent - e2).abs().max() < 1e-3


@pytest.mark.parametrize("rand4", [True, False])
@pytest.mark.parametrize(
    "C",  # draws per group: one program per row under the interpreter, so 320 takes minutes on CPU
    [64, pytest.param(320, marks=pytest.mark.large)],
)
def test_sample_draws_follow_the_softmax_and_ignore_the_batch(rand4, C):
    """Per group: the draws' frequencies match softmax(logits * inv_temp) (fixed seeds: deterministic;
    the bound is 4 standard errors at C draws), the statistics match softmax_argmax's, and a group's
    draws are the same launched alone."""
    base = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0, 3.0, float("-inf")])
    inv, seeds = torch.tensor([1.0, 0.5]), torch.tensor([11, 2**62 + 5])
    logits = base.repeat(2 * C, 1).to(DEVICE)
    conf, arg, ent, draw, noise, _, _ = softmax_sample(
        logits, inv.to(DEVICE), seeds.to(DEVICE), C, impl="triton", rand4=rand4
    )
    c2, a2, e2 = softmax_argmax_reference(logits * inv.repeat_interleave(C)[:, None].to(DEVICE))
    assert torch.equal(arg, a2) and (ent - e2).abs().max() < 1e-5 and (conf - c2).abs().max() < 1e-5
    assert int(draw.max()) < 6 and 0 <= int(noise.min()) and int(noise.max()) < 7  # -inf is never drawn
    for g in range(2):
        p = torch.softmax(base * inv[g], -1)
        freq = torch.bincount(draw[g * C : (g + 1) * C].cpu(), minlength=7).float() / C
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / C).sqrt() + 0.01).all(), (g, freq, p)
    assert len(set(noise.tolist())) == 7  # renoise covers the vocabulary
    alone = softmax_sample(
        logits[C:].contiguous(), inv[1:].to(DEVICE), seeds[1:].to(DEVICE), C, impl="triton", rand4=rand4
    )
    assert torch.equal(alone[3], draw[C:]) and torch.equal(alone[4], noise[C:])
    other = softmax_sample(logits, inv.to(DEVICE), (seeds + 1).to(DEVICE), C, impl="triton", rand4=rand4)
    assert not torch.equal(other[3], draw)


def test_sample_top_k_matches_torch_topk():
    """The thresholded top-k (lane maxima, then one gathering read) returns torch.topk's values and ids
    on the scaled logits, a flat row (more candidates than slots) through the fallback included."""
    logits = _logits(6, 5000, torch.float32, seed=3)
    logits[4] = 0.0  # every logit ties: 5000 candidates, past the slots
    logits[5, 100:] = float("-inf")  # fewer finite logits than lanes
    inv, seeds = torch.tensor([1.25, 0.5, 2.0]).to(DEVICE), torch.tensor([1, 2, 3]).to(DEVICE)
    out = softmax_sample(logits, inv, seeds, 2, top_k=64, impl="triton")
    ref_v, ref_i = torch.topk(logits * inv.repeat_interleave(2)[:, None], 64, dim=-1)
    assert torch.equal(out.top_vals, ref_v)
    assert torch.equal(out.top_ids[:4], ref_i[:4]) and torch.equal(out.top_ids[5], ref_i[5])
    assert len(set(out.top_ids[4].tolist())) == 64  # a tie: any 64 distinct ids


def test_sample_top_k_of_masked_rows_skips_the_masked_logits(monkeypatch):
    """Structured output's masked logits (`NEG`) are never top-k candidates: a row with fewer unmasked
    logits than k (a constrained position) gets torch.topk's unmasked entries, then -inf with id 0,
    and no fallback (the count stays under the slots); its softmax weights over the k equal torch's,
    whose masked entries weigh nothing. A row with more unmasked logits than k is torch's exactly."""
    from canvasq.decoders.constraint_rules import NEG

    V, k = 5000, 64
    logits = _logits(4, V, torch.float32, seed=5).cpu()
    allowed = {0: [7, 12, 4096, 4999], 1: list(range(10, 40)), 2: [3], 3: list(range(0, V, 50))}
    for r, cols in allowed.items():
        keep = torch.zeros(V, dtype=torch.bool)
        keep[cols] = True
        logits[r, ~keep] = NEG
    inv, seeds = torch.tensor([1.25, 0.5]).to(DEVICE), torch.tensor([1, 2]).to(DEVICE)
    calls = []
    topk = torch.topk

    def counted(*a, **kw):  # the kernel path sorts its slots; a fallback sorts [n, V] rows
        calls.append(a[0].shape[-1])
        return topk(*a, **kw)

    monkeypatch.setattr(torch, "topk", counted)
    out = softmax_sample(logits.to(DEVICE), inv, seeds, 2, top_k=k, impl="triton")
    monkeypatch.undo()
    assert V not in calls  # no row went to the full-vocabulary fallback
    scaled = logits.to(DEVICE) * inv.repeat_interleave(2)[:, None]
    ref_v, ref_i = torch.topk(scaled, k, dim=-1)
    for r, cols in allowed.items():
        n = min(len(cols), k)
        assert torch.equal(out.top_vals[r, :n], ref_v[r, :n]) and torch.equal(
            out.top_ids[r, :n], ref_i[r, :n]
        )
        assert torch.isneginf(out.top_vals[r, n:]).all() and not out.top_ids[r, n:].any()
        assert torch.equal(out.top_vals[r].softmax(-1), ref_v[r].softmax(-1))


def test_sample_top_k_across_slices():
    """At a vocabulary split into several stage-1 slices, peaks planted in every slice and in one lane's
    far columns come back as torch.topk's."""
    R, V = 3, 40000  # 4 slices of 5 blocks of 2,048 columns (the last one partly past V)
    logits = _logits(R, V, torch.float32, seed=7).cpu()
    logits[0, [5, 10245, 20491, 30736, 39999]] = 40.0 + torch.arange(5.0)  # a peak in every slice
    logits[1, 3 + 2048 * torch.arange(5)] = 30.0 + torch.arange(5.0)  # one lane's columns, one slice
    logits[2, 10240 + 7 + 2048 * torch.arange(5)] = 30.0 + torch.arange(5.0)  # the same, slice 1
    inv, seeds = torch.tensor([1.0, 0.7, 1.3]).to(DEVICE), torch.tensor([1, 2, 3]).to(DEVICE)
    out = softmax_sample(logits.to(DEVICE), inv, seeds, 1, top_k=64, impl="triton")
    ref_v, ref_i = torch.topk(logits.to(DEVICE) * inv[:, None], 64, dim=-1)
    assert torch.equal(out.top_vals, ref_v) and torch.equal(out.top_ids, ref_i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap_applied_on_read_matches_capped_logits(dtype):
    """`cap`: the sampler reads the LM head's output before its final soft cap and caps as it reads;
    statistics, draws and top k equal those over the capped logits (`softcap.py`'s math, torch's tanh
    on the capped side: the interpreter's tanh is a few ulps off, hence the tolerances), and a flat
    row's fallback caps too."""
    raw = (_logits(6, 5000, torch.float32, seed=5) * 3).to(dtype)  # many logits past the cap's knee
    raw[4] = 3.0  # every logit ties: the top k's fallback
    capped = (raw.float() / 30.0).tanh() * 30.0
    inv, seeds = torch.tensor([1.25, 0.5, 2.0]).to(DEVICE), torch.tensor([1, 2, 3]).to(DEVICE)
    on_read = softmax_sample(raw, inv, seeds, 2, top_k=64, impl="triton", cap=30.0)
    ref = softmax_sample(capped, inv, seeds, 2, top_k=64, impl="triton")
    assert not torch.allclose(raw.float(), capped)  # the cap matters on these rows
    for got, want in ((on_read.conf, ref.conf), (on_read.entropy, ref.entropy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(on_read.argmax, ref.argmax) and torch.equal(on_read.draw, ref.draw)
    assert torch.equal(on_read.noise, ref.noise)
    torch.testing.assert_close(on_read.top_vals, ref.top_vals, rtol=1e-5, atol=1e-5)
    assert torch.equal(on_read.top_ids[:4], ref.top_ids[:4]) and torch.equal(
        on_read.top_ids[5], ref.top_ids[5]
    )
    torch.testing.assert_close(on_read.top_vals[4], ref.top_vals[4])  # the tie: any ids, capped values
    twin = softmax_sample(raw, inv, seeds, 2, top_k=64, impl="torch", cap=30.0)
    torch.testing.assert_close(twin.top_vals, ref.top_vals, rtol=1e-5, atol=1e-5)
    assert torch.equal(twin.argmax, ref.argmax)


def test_invcdf_draws_follow_the_softmax_through_slices_lanes_and_columns():
    """`draw="invcdf"` (softmax_invcdf): with 8 lanes and 2 slices, mass on columns that differ by
    slice (44, 69), by lane (3 against 44) and by column within one lane (3, 11, 19): every draw lands
    on one of them at softmax's frequencies (4 standard errors at 64 draws a group); the statistics
    are softmax's; a group's draws are the same launched alone, and other seeds draw otherwise; the
    soft cap on read draws what the capped logits draw."""
    from canvasq.decoders import configs
    from canvasq.kernels import softmax_invcdf
    from canvasq.kernels.softmax_argmax import softmax_sample_launch

    C, hot = 64, torch.tensor([3, 11, 19, 44, 69])
    base = torch.full((70,), -30.0)
    base[hot] = torch.tensor([1.0, 0.0, 2.0, 1.5, 0.5])
    base[[5, 30, 60]] = float("-inf")
    inv, seeds = torch.tensor([1.0, 0.5]).to(DEVICE), torch.tensor([7, 2**61 + 3]).to(DEVICE)
    logits = base.repeat(2 * C, 1).to(DEVICE)

    def sample(x, inv, seeds, group=C, cap=None, draw="invcdf"):
        return softmax_sample_launch(x, inv, seeds, group, block_v=8, draw=draw, cap=cap)

    out = sample(logits, inv, seeds)
    c2, a2, e2 = softmax_argmax_reference(logits * inv.repeat_interleave(C)[:, None])
    assert torch.equal(out.argmax, a2) and (out.entropy - e2).abs().max() < 1e-5
    assert (out.conf - c2).abs().max() < 1e-5
    assert set(out.draw.tolist()) <= set(hot.tolist())
    for g in range(2):
        p = torch.softmax(base * inv[g].cpu(), -1)[hot]
        counts = torch.bincount(out.draw[g * C : (g + 1) * C].cpu(), minlength=70)[hot].float()
        assert ((counts / C - p).abs() <= 4 * (p * (1 - p) / C).sqrt() + 0.01).all(), (g, counts, p)
    few = logits[C : C + 16].contiguous()  # the second group's first 16 rows, a group of their own
    alone = sample(few, inv[1:], seeds[1:], group=16)
    assert torch.equal(alone.draw, out.draw[C : C + 16])
    assert not torch.equal(sample(few, inv[1:], seeds[1:] + 1, group=16).draw, alone.draw)
    raw = few * 3
    capped = (raw / 30.0).tanh() * 30.0
    on_read = sample(raw, inv[1:], seeds[1:], group=16, cap=30.0)
    assert torch.equal(on_read.draw, sample(capped, inv[1:], seeds[1:], group=16).draw)
    with pytest.raises(ValueError, match="draw"):
        sample(logits, inv, seeds, draw="argmax")
    assert configs.DRAWS == softmax_invcdf.DRAWS  # the decoder's knob names the kernel's rules
