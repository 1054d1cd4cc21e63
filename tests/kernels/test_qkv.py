"""Fused QKV (one GEMM over concatenated, LoRA-merged weights) vs three projections."""

import torch
from kernel_testutil import DEVICE, rel_err

from canvasq.kernels.qkv import fuse_attention_module, fuse_qkv_weights, qkv_proj, qkv_proj_reference


def test_fused_qkv_matches_three_linears():
    H, nq, nk = 96, 128, 64
    qw, kw, vw = (torch.randn(n, H, device=DEVICE) for n in (nq, nk, nk))
    x = torch.randn(2, 7, H, device=DEVICE)
    fused = fuse_qkv_weights(qw, kw, vw)
    q, k, v = qkv_proj(x, fused)
    q2, k2, v2 = qkv_proj_reference(x, qw, kw, vw)
    assert fused.splits == (nq, nk, nk) and q.shape == (2, 7, nq) and v.shape == (2, 7, nk)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert rel_err(a, b) < 1e-5


def test_fused_qk_without_v_and_with_bias():
    H = 64
    qw, kw = torch.randn(64, H, device=DEVICE), torch.randn(32, H, device=DEVICE)
    qb, kb = torch.randn(64, device=DEVICE), torch.randn(32, device=DEVICE)
    x = torch.randn(5, H, device=DEVICE)
    q, k, v = qkv_proj(x, fuse_qkv_weights(qw, kw, None, qb, kb))
    q2, k2, _ = qkv_proj_reference(x, qw, kw, None, qb, kb)
    assert v is None and rel_err(q, q2) < 1e-5 and rel_err(k, k2) < 1e-5


def test_from_attention_module():
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(48, n, bias=False) for n in (96, 32, 32))
    attn.to(DEVICE)
    x = torch.randn(3, 48, device=DEVICE)
    q, _, v = qkv_proj(x, fuse_attention_module(attn))
    assert rel_err(v, attn.v_proj(x)) < 1e-5 and rel_err(q, attn.q_proj(x)) < 1e-5
