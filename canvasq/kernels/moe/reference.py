"""Pure-torch twins of the W4 MoE: the same math on dequantised weights.

Letters: T tokens, K top-k, E experts, H hidden, I expert width.
Bytes (BF16 reference, one call): reads every routed expert's gate_up [2I, H] and down [H, I] in 16 bits,
i.e. 3*H*I*2 bytes per touched expert, plus x [T, H] and the [T*K, H] per-assignment outputs.
"""

from __future__ import annotations

import torch

from .quant import W4Experts, unpack_w4


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I] (any float dtype) -> [T, H] in x.dtype.

    Per assignment in x.dtype (as HF's experts do), then each token's K outputs summed in fp32 in
    fixed k order (deterministic, like the Triton combine).
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    I = down.shape[2]
    flat = topk_ids.reshape(-1)
    y_tk = torch.zeros(T * K, H, dtype=x.dtype, device=x.device)
    for e in torch.unique(flat).tolist():
        aid = (flat == e).nonzero().squeeze(1)
        xe = x[aid // K]
        gu = xe @ gate_up[e].to(x.dtype).t()
        h = gelu_tanh(gu[:, :I].float()) * gu[:, I:].float()
        y_tk[aid] = h.to(x.dtype) @ down[e].to(x.dtype).t()
    return combine_reference(y_tk, topk_weights)


def combine_reference(y_tk: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's K rows of y_tk [T*K, H] weighted by weights [T, K] and summed in fp32 -> [T, H] in
    y_tk's dtype (the combine kernel's twin)."""
    T, K = weights.shape
    return (y_tk.view(T, K, -1).float() * weights.float()[..., None]).sum(1).to(y_tk.dtype)


def route_weights(topk_p: torch.Tensor, topk_ids: torch.Tensor, expert_scale: torch.Tensor) -> torch.Tensor:
    """DiffusionGemma's router epilogue (HF's op order): top-k probabilities renormalised to sum 1 per
    token, times the chosen experts' scales. [T, K] fp32."""
    w = topk_p / topk_p.sum(dim=-1, keepdim=True)
    return w * expert_scale[topk_ids]


def w4_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: W4Experts,
    expert_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of `w4_moe`: dequantise (fp32 math, cast to x.dtype), then `moe_reference`."""
    gate_up, down = unpack_w4(packed, x.dtype)
    if expert_scale is not None:
        topk_weights = route_weights(topk_weights, topk_ids, expert_scale)
    return moe_reference(x, topk_ids, topk_weights, gate_up, down)
