"""The D2F training objectives on a toy model: uniform noise, argmax drafts, on-policy commits."""

import torch

from canvasq.model.shapes import build_config, toy_shape
from canvasq.testbed.train_loss import denoise_loss


def _toy():
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(build_config(toy_shape())).eval()


def _batch(shape, b=3, ctx_len=10, k=2, level=0.6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(5, shape.vocab_size, (b, ctx_len), generator=g)
    mask = torch.ones(b, ctx_len, dtype=torch.bool)
    target = torch.randint(5, shape.vocab_size, (b, k * shape.canvas_length), generator=g)
    corrupt = torch.rand(target.shape, generator=g) < level
    noisy = torch.where(corrupt, torch.randint(0, shape.vocab_size, target.shape, generator=g), target)
    return ctx, mask, target, noisy


def test_objectives_run_and_on_policy_trains_only_open_positions():
    shape = toy_shape()
    model = _toy()
    batch = _batch(shape)
    C = shape.canvas_length
    for kw in ({}, {"draft_rounds": 2}, {"draft_rounds": 2, "commit_tau": (0.0, 0.0)}):
        g = torch.Generator().manual_seed(3)
        loss = denoise_loss(model, batch, 2, C, 0.5, g, **kw)
        assert torch.isfinite(loss) and loss.item() > 0
    # a fixed bar above 1 commits nothing (and draws no random number), so the on-policy loss covers
    # exactly the corrupted positions;
    # the plain draft objective covers every position: whenever a draft pass runs (r >= 1, drawn
    # from the generator) the two losses differ
    differ = 0
    for seed in range(6):
        never = denoise_loss(
            model,
            batch,
            2,
            C,
            0.5,
            torch.Generator().manual_seed(seed),
            draft_rounds=1,
            commit_tau=(1.5, 1.5),
        )
        drafts = denoise_loss(model, batch, 2, C, 0.5, torch.Generator().manual_seed(seed), draft_rounds=1)
        assert torch.isfinite(never) and torch.isfinite(drafts)
        differ += int(not torch.equal(never, drafts))
    assert differ >= 1
