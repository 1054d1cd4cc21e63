"""The testbed's training objective (`train.py`, `repair.py`): the context through the encoder once
(`encode_context`), the decoder's block-causal masks over K canvases (`block_causal_masks`) and the
cross-entropy of its prediction of the clean canvases (`denoise_loss`), with self-conditioning or
argmax-draft passes first; digits weighted up (`digit_weights`).
"""

from __future__ import annotations

from canvasq.model.loading import cache_kwargs


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def block_causal_masks(model, ctx_mask, n_canvases: int, canvas: int, cache):
    """4D boolean decoder masks for K canvases after a context of length L (True = may attend).

    Keys are [cached context entries] ‖ [K·C window rows]. Row r of canvas k sees context keys
    (not padding) and window rows of canvases ≤ k. On sliding layers the cache holds only the
    last W − 1 context entries and every key must also lie at position ≥ start(k) − (W − 1)."""
    import torch

    tc = model.config.text_config
    B, L = ctx_mask.shape
    KC = n_canvases * canvas
    rows = torch.arange(KC, device=ctx_mask.device)
    can_of_row = rows // canvas
    start = L + can_of_row * canvas  # absolute position of each row's canvas start
    win_ok = can_of_row[None, :] <= can_of_row[:, None]  # [KC, KC] block-causal
    masks = {}
    for kind in set(tc.layer_types):
        if kind == "sliding_attention":
            keep = min(L, tc.sliding_window - 1)
            ctx_pos = torch.arange(L - keep, L, device=ctx_mask.device)
            ctx_ok = ctx_mask[:, L - keep :]
            lo = start - (tc.sliding_window - 1)
            band_ctx = ctx_pos[None, :] >= lo[:, None]  # [KC, keep]
            win_pos = L + rows
            band_win = win_pos[None, :] >= lo[:, None]
            m_ctx = ctx_ok[:, None, :] & band_ctx[None]
            m_win = (win_ok & band_win)[None].expand(B, -1, -1)
        else:
            m_ctx = ctx_mask[:, None, :].expand(B, KC, L)
            m_win = win_ok[None].expand(B, -1, -1)
        masks[kind] = torch.cat([m_ctx, m_win], dim=-1)[:, None]
    return masks


def encode_context(model, ctx, ctx_mask):
    """The context (left-padded prompt ‖ earlier canvases) through the encoder once; its KV cache is what
    every decoder pass of the step attends to."""
    import torch
    from transformers import DynamicCache

    B, L = ctx.shape
    tc = model.config.text_config
    pos = torch.arange(L, device=ctx.device)[None].expand(B, -1)
    enc = model.model.encoder(
        input_ids=ctx,
        attention_mask=ctx_mask.long(),
        position_ids=pos,
        **cache_kwargs(model.model.encoder, DynamicCache(config=tc)),
    )
    return _cache_of(enc)


def denoise_loss(
    model,
    batch,
    n_canvases: int,
    canvas: int,
    sc_prob: float,
    gen,
    token_weight=None,
    draft_rounds: int = 0,
    commit_tau: tuple[float, float] | None = None,
):
    """Cross-entropy of the decoder's prediction of the clean canvases (optionally with SC).

    `draft_rounds` > 0 (the D2F adapter): the step draws r in 0..draft_rounds and first runs r
    gradient-free passes, each replacing the corrupted positions with the previous pass's argmax and
    feeding its raw logits back as SC — the state the pipe / funnel decoders are in after r steps of
    argmax renoise. The trained pass then sees the model's own drafts instead of uniform noise.

    `commit_tau` (lo, hi) makes those passes on-policy for the step decoders' final commits: a bar
    τ ~ U(lo, hi) is drawn, each pass commits the open positions whose confidence clears it (frozen,
    right or wrong, as the pipe commits them), and the loss covers only the positions still open —
    the ones whose confidence the next commit decision reads."""
    import torch

    ctx, ctx_mask, target, noisy = batch
    B = ctx.shape[0]
    cache = encode_context(model, ctx, ctx_mask)
    kw = _decoder_kwargs(model, ctx_mask, noisy, cache, n_canvases, canvas)
    sc_logits, sc_mask = None, None
    rounds = 0
    if draft_rounds:
        rounds = int(torch.randint(0, draft_rounds + 1, (1,), device=ctx.device, generator=gen))
    open_ = None
    if rounds:
        sc_logits, open_ = _draft_passes(model, kw, noisy, target, rounds, commit_tau, gen)
        sc_mask = torch.rand(B, device=ctx.device, generator=gen) < max(sc_prob, 0.9)
    elif sc_prob > 0:
        sc_logits, sc_mask = _self_conditioning(model, kw, B, sc_prob, gen)
    logits = model(**kw, self_conditioning_logits=sc_logits, self_conditioning_mask=sc_mask).logits
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none"
    )
    w = token_weight[target.reshape(-1)] if token_weight is not None else torch.ones_like(ce)
    if open_ is not None and bool(open_.any()):
        w = w * open_.reshape(-1)
    return (ce * w).sum() / w.sum()


def _decoder_kwargs(model, ctx_mask, noisy, cache, n_canvases: int, canvas: int) -> dict:
    """The decoder's inputs after the cached context: positions continue the context's, and K > 1
    canvases see each other block-causally (one canvas needs only the context's padding mask)."""
    import torch

    B, L = ctx_mask.shape
    dpos = torch.arange(L, L + n_canvases * canvas, device=ctx_mask.device)[None].expand(B, -1)
    if n_canvases == 1:
        dmask = torch.nn.functional.pad(ctx_mask, (0, canvas), value=True).long()
    else:
        dmask = block_causal_masks(model, ctx_mask, n_canvases, canvas, cache)
    return {
        **cache_kwargs(model, cache),
        "decoder_input_ids": noisy,
        "decoder_attention_mask": dmask,
        "decoder_position_ids": dpos,
    }


def _draft_passes(model, kw: dict, noisy, target, rounds: int, commit_tau, gen):
    """`rounds` gradient-free argmax-draft passes (denoise_loss's docstring); `kw["decoder_input_ids"]`
    ends as the last drafts. Returns (the last pass's logits as SC, the positions still open or None
    without `commit_tau`)."""
    import torch

    corrupt = noisy != target
    open_ = None
    if commit_tau is not None:
        lo, hi = commit_tau
        tau = lo
        if hi > lo:
            tau = lo + (hi - lo) * float(torch.rand(1, device=noisy.device, generator=gen))
        open_ = corrupt.clone()
    sc_logits = None
    with torch.no_grad():
        for _ in range(rounds):
            first = model(**kw, self_conditioning_logits=sc_logits).logits
            if open_ is None:
                kw["decoder_input_ids"] = torch.where(corrupt, first.argmax(-1), target)
            else:  # committed positions keep the id they were committed with
                conf, arg = torch.softmax(first.float(), dim=-1).max(dim=-1)
                kw["decoder_input_ids"] = torch.where(open_, arg, kw["decoder_input_ids"])
                open_ &= conf < tau
            sc_logits = first.to(model.dtype)  # the decoders feed raw logits back
    return sc_logits, open_


def _self_conditioning(model, kw: dict, B: int, sc_prob: float, gen):
    """(SC logits, per-row mask) from a gradient-free pass on the same input, for a `sc_prob` share of
    the rows."""
    import torch

    with torch.no_grad():
        first = model(**kw).logits
    # The official sampler feeds temperature-scaled logits (t from 0.8 down to 0.4) back as SC.
    temp = 0.4 + 0.4 * torch.rand(B, 1, 1, device=first.device, generator=gen)
    sc_logits = (first / temp).to(model.dtype)
    sc_mask = torch.rand(B, device=first.device, generator=gen) < sc_prob
    return sc_logits, sc_mask


def digit_weights(tok, vocab: int, weight: float, device):
    """Per-token CE weights: `weight` on the digits 0-9, 1 elsewhere. Digits carry the arithmetic: they
    are a few percent of answer tokens but all of its difficulty."""
    import torch

    token_weight = torch.ones(vocab, device=device)
    token_weight[[tok.convert_tokens_to_ids(str(d)) for d in range(10)]] = weight
    return token_weight
