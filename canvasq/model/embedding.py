"""A forward's inputs to the first layer: token embeddings with the self-conditioning signal added
(decoder rows; the full logits' or the top-k's expected embedding through the SC MLP) and the rotary
tables of the rows' positions. Called inside `Runtime._run` (device work only: capturable)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from canvasq.kernels.soft_embed import soft_embed
from canvasq.model.experts import gelu_tanh

if TYPE_CHECKING:
    from canvasq.model.prepared import Prepared
    from canvasq.model.runtime import Runtime


def embed(rt: Runtime, prep: Prepared) -> torch.Tensor:
    """[N, H]: the rows' embeddings; decoder rows get post_norm(h + MLP(pre_norm(soft))) where they
    have SC. Rows without SC get soft = 0, whose MLP output is exactly 0 (HF's "no logits" case), so
    they need no special path."""
    scale = rt.embed_scale.to(rt.dtype)
    h = F.embedding(prep.ids, rt.embed) * scale  # [N, H]
    if prep.encoder:
        return h
    if prep.sc:
        with rt.scope("self_cond"):
            softs, rows = [], []
            for r, keep, payload in prep.sc:
                s = soft_embedding(rt, payload) * scale  # [R, H]
                softs.append(s if keep is None else s * keep)
                rows.append(r)
            soft = torch.cat(softs) if len(softs) > 1 else softs[0]
            r = torch.cat(rows) if len(rows) > 1 else rows[0]
            x = rt._norm(soft, rt.sc["pre_norm"], rt.eps)
            sig = F.linear(gelu_tanh(F.linear(x, rt.sc["gate"])) * F.linear(x, rt.sc["up"]), rt.sc["down"])
            h = h.index_add(0, r, sig)
    if prep.enc_rows is not None:  # the encoder's rows enter without the decoder's input norm
        return torch.where(prep.enc_rows[:, None], h, rt._norm(h, None, rt.eps))
    return rt._norm(h, None, rt.eps)


def soft_embedding(rt: Runtime, sc) -> torch.Tensor:
    """Expected embedding under the previous step's prediction. Full: [R, V] logits; top-k:
    (ids [R, k], logits [R, k]) renormalised over the k entries."""
    if isinstance(sc, tuple):
        tid, tlog = sc
        p = torch.softmax(tlog.to(rt.device).float(), dim=-1).to(rt.dtype)  # [R, k]
        # Σ_k p_k · E[id_k] in one kernel: the k rows are read, never stored as [R, k, H]
        return soft_embed(tid.to(rt.device), p, rt.embed, impl=rt.sc_bag)
    p = torch.softmax(sc.to(rt.device).float(), dim=-1).to(rt.dtype)  # [R, V]
    return p @ rt.embed


def rope(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """(cos, sin) [N, d] of the rows' positions, computed in fp32 then cast (HF's order)."""
    freqs = pos[:, None].float() * inv_freq.to(pos.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
