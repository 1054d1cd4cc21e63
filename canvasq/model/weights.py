"""One transformer layer's weights as the runtime reads them: references into the HF model's
modules (nothing copied), plus the concatenated q/k/v and dense gate/up the runtime multiplies in one
GEMM each, and the FP8 copies `fp8.install_fp8` adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from canvasq.kernels.moe.quant import W4Experts


@dataclass
class LayerWeights:
    """One transformer layer's tensors (references into the HF model; nothing copied)."""

    sliding: bool
    heads: int
    kv_heads: int
    head_dim: int
    wq: torch.Tensor  # [h*d, H]
    wk: torch.Tensor  # [kv*d, H]
    wv: torch.Tensor | None  # None on V = K layers (V from k_proj)
    wo: torch.Tensor  # [H, h*d]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ln_in: torch.Tensor
    ln_post_attn: torch.Tensor
    ln_pre_ff: torch.Tensor
    ln_post_ff1: torch.Tensor
    ln_pre_ff2: torch.Tensor
    ln_post_ff2: torch.Tensor
    ln_post_ff: torch.Tensor
    mlp_gate: torch.Tensor  # [Id, H]
    mlp_up: torch.Tensor
    mlp_down: torch.Tensor  # [H, Id]
    router_scale: torch.Tensor  # [H]
    router_proj: torch.Tensor  # [E, H]
    per_expert_scale: torch.Tensor  # [E]
    gate_up: torch.Tensor | None  # [E, 2I, H] (None: freed when the model's experts were packed at load)
    down: torch.Tensor | None  # [E, H, I]
    layer_scalar: torch.Tensor  # [1]
    experts_packed: W4Experts | None = (
        None  # W4Experts when experts="w4" (or installed by `pack_model_experts`)
    )
    wqkv: torch.Tensor | None = None  # [(h + kv [+ kv]) * d, H]: q, k (and v) in one GEMM
    mlp_gate_up: torch.Tensor | None = None  # [2 * Id, H]: the dense MLP's gate and up in one GEMM
    fp8: dict = field(
        default_factory=dict
    )  # {"wqkv" | "wo" | "mlp_gate_up" | "mlp_down" | "experts": FP8 copy}


def fuse_projections(layers: list[LayerWeights]) -> None:
    """Concatenate q/k/v and the dense gate/up weights once (shared by the encoder and decoder
    layers, whose weights HF ties). Costs one extra copy of those weights (real shape: ~2.8 GB
    bf16); saves three GEMM launches per layer and forward."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for lw in layers:
        key = lw.wq.data_ptr()
        if key not in done:
            qkv = [lw.wq, lw.wk] + ([lw.wv] if lw.wv is not None else [])
            done[key] = (torch.cat(qkv).contiguous(), torch.cat([lw.mlp_gate, lw.mlp_up]).contiguous())
        lw.wqkv, lw.mlp_gate_up = done[key]


def layer_weights(layer) -> LayerWeights:
    at = layer.self_attn
    d = at.q_norm.weight.shape[0]
    heads = at.q_proj.weight.shape[0] // d
    kvh = at.k_proj.weight.shape[0] // d
    return LayerWeights(
        sliding=bool(at.is_sliding),
        heads=heads,
        kv_heads=kvh,
        head_dim=d,
        wq=at.q_proj.weight,
        wk=at.k_proj.weight,
        wv=at.v_proj.weight if at.v_proj is not None else None,
        wo=at.o_proj.weight,
        q_norm=at.q_norm.weight,
        k_norm=at.k_norm.weight,
        ln_in=layer.input_layernorm.weight,
        ln_post_attn=layer.post_attention_layernorm.weight,
        ln_pre_ff=layer.pre_feedforward_layernorm.weight,
        ln_post_ff1=layer.post_feedforward_layernorm_1.weight,
        ln_pre_ff2=layer.pre_feedforward_layernorm_2.weight,
        ln_post_ff2=layer.post_feedforward_layernorm_2.weight,
        ln_post_ff=layer.post_feedforward_layernorm.weight,
        mlp_gate=layer.mlp.gate_proj.weight,
        mlp_up=layer.mlp.up_proj.weight,
        mlp_down=layer.mlp.down_proj.weight,
        router_scale=layer.router.scale,
        router_proj=layer.router.proj.weight,
        per_expert_scale=layer.router.per_expert_scale,
        gate_up=getattr(layer.experts, "gate_up_proj", None),  # gone once `pack_model_experts` ran
        down=getattr(layer.experts, "down_proj", None),
        layer_scalar=layer.layer_scalar,
        experts_packed=getattr(layer.experts, "w4_experts", None),
    )


EXPERT_IMPLS = ("bf16", "reference", "grouped", "w4")  # `Runtime(experts=...)`


def rope_tables(rot) -> tuple[dict[bool, torch.Tensor], dict[bool, float]]:
    """HF's rotary module's inverse frequencies (fp32) and attention scaling, keyed by sliding?"""
    inv_freq, rope_scaling = {}, {}
    for lt, sliding in (("sliding_attention", True), ("full_attention", False)):
        if hasattr(rot, f"{lt}_inv_freq"):
            inv_freq[sliding] = getattr(rot, f"{lt}_inv_freq").float()
            rope_scaling[sliding] = float(getattr(rot, f"{lt}_attention_scaling"))
    return inv_freq, rope_scaling


def checked_text_config(hf_model, experts: str):
    """The model's text config, after what this runtime does not implement is refused by name."""
    if experts not in EXPERT_IMPLS:
        raise ValueError(f"unknown experts implementation {experts!r}; known: {', '.join(EXPERT_IMPLS)}")
    tc = hf_model.config.get_text_config()
    if tc.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported activation {tc.hidden_activation!r}")
    if getattr(tc, "attn_logit_softcapping", None):
        raise ValueError("attention logit softcapping is not implemented")
    return tc


def pack_experts_w4(layers: list[LayerWeights], dtype: torch.dtype) -> None:
    """Pack each distinct expert tensor of `layers` once (encoder and decoder share them); on CUDA the
    packs are kept in the Gluon kernels' tiled order (`prefer_tiled`: one copy, the faster kernels).
    Packs that `pack_model_experts` installed at load are used as they are (their BF16 weights are gone)."""
    from canvasq.kernels.moe import pack_w4
    from canvasq.kernels.moe.launch import prefer_tiled

    packed: dict[int, W4Experts] = {}
    for lw in layers:
        if lw.experts_packed is not None:
            continue
        assert lw.gate_up is not None and lw.down is not None  # freed only where packed at load
        key = lw.gate_up.data_ptr()
        if key not in packed:
            packed[key] = prefer_tiled(pack_w4(lw.gate_up, lw.down), dtype)
        lw.experts_packed = packed[key]
