"""The testbed's training data (`train.py`): the train split of every task family tokenised into one
padded id matrix (`build_pool`: row = prompt ‖ answer padded to whole canvases), and the batches of
the uniform-state objective drawn from it on the training device (`Batches`: context, target canvases,
their noisy versions).
"""

from __future__ import annotations

import math
from multiprocessing import Pool

import numpy as np

from canvasq.testbed.config import BOS_ID, EOS_ID, PAD_ID, SEP_ID


def _encode_chunk(args):
    task, seed, n, tok_dir = args
    from transformers import AutoTokenizer

    from canvasq.testbed import tasks

    tok = AutoTokenizer.from_pretrained(tok_dir)
    probs = tasks.generate(task, n, seed, split="train")
    prompts = tok([p.prompt for p in probs], add_special_tokens=False)["input_ids"]
    answers = tok([p.answer for p in probs], add_special_tokens=False)["input_ids"]
    return [([BOS_ID, *p, SEP_ID], [*a, EOS_ID]) for p, a in zip(prompts, answers)]


def build_pool(n_per_task: int, seed: int, tok_dir: str, canvas: int, workers: int):
    """All problems (the train split) as one padded id matrix: row = prompt ‖ answer padded to whole
    canvases."""
    chunk = 5000
    jobs = [
        (task, seed * 1_000_003 + i, min(chunk, n_per_task - i * chunk), tok_dir)
        for task in ("arith", "code")
        for i in range(math.ceil(n_per_task / chunk))
    ]
    with Pool(workers) as pool:
        rows = [r for part in pool.map(_encode_chunk, jobs) for r in part]
    max_p = max(len(p) for p, _ in rows)
    max_c = max(math.ceil(len(a) / canvas) for _, a in rows)
    seq = np.full((len(rows), max_p + max_c * canvas), PAD_ID, dtype=np.int64)
    plen = np.zeros(len(rows), dtype=np.int64)
    ncan = np.zeros(len(rows), dtype=np.int64)
    for i, (p, a) in enumerate(rows):
        seq[i, : len(p)] = p
        seq[i, len(p) : len(p) + len(a)] = a
        plen[i], ncan[i] = len(p), math.ceil(len(a) / canvas)
    return seq, plen, ncan


class Batches:
    """Vectorised batch assembly on the training device (no Python per example)."""

    def __init__(self, seq, plen, ncan, canvas: int, vocab: int, device):
        import torch

        self.torch = torch
        self.seq = torch.as_tensor(seq, device=device)
        self.plen = torch.as_tensor(plen, device=device)
        self.ncan = torch.as_tensor(ncan, device=device)
        self.C, self.V, self.device = canvas, vocab, device

    def sample(self, batch: int, n_canvases: int, gen, shift: bool = False):
        """Rows: (left-padded context, its mask, K target canvases, their noisy versions).

        The first target canvas index j is uniform over the answer; the context is the prompt
        plus canvases < j. With K > 1 the K canvases after it follow (pads past the answer's end
        are legitimate targets: the sampler writes pad after EOS). `shift`: the context also takes
        0..C-1 further answer tokens, so the canvases start anywhere (phcd's window starts at the
        committed prefix, not on a canvas boundary)."""
        torch, C = self.torch, self.C
        idx = torch.randint(0, self.seq.shape[0], (batch,), device=self.device, generator=gen)
        nc = self.ncan[idx]
        j = (torch.rand(batch, device=self.device, generator=gen) * nc).long()
        ctx_len = self.plen[idx] + j * C
        if shift:
            ctx_len = ctx_len + torch.randint(0, C, (batch,), device=self.device, generator=gen)
        L = int(ctx_len.max())
        t = torch.arange(L, device=self.device)
        src = t[None, :] - (L - ctx_len)[:, None]
        ctx_mask = src >= 0
        ctx = torch.where(ctx_mask, self.seq[idx[:, None], src.clamp(min=0)], PAD_ID)
        tgt_pos = ctx_len[:, None] + torch.arange(n_canvases * C, device=self.device)[None, :]
        in_range = tgt_pos < self.seq.shape[1]
        target = torch.where(
            in_range, self.seq[idx[:, None], tgt_pos.clamp(max=self.seq.shape[1] - 1)], PAD_ID
        )
        # Noise level per canvas: increasing along the K canvases (D2F schedule), uniform for K = 1.
        base = torch.rand(batch, 1, device=self.device, generator=gen)
        if n_canvases > 1:
            steps = torch.rand(batch, n_canvases, device=self.device, generator=gen).sort(dim=1).values
            level = (steps * (1 - base) + base * 0.3).clamp(max=1.0)
        else:
            level = base
        level = level.repeat_interleave(C, dim=1)
        corrupt = torch.rand(target.shape, device=self.device, generator=gen) < level
        noise = torch.randint(0, self.V, target.shape, device=self.device, generator=gen)
        noisy = torch.where(corrupt, noise, target)
        return ctx, ctx_mask, target, noisy
