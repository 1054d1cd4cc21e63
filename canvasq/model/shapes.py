"""Named model shapes: `random:26b-a4b` is google/diffusiongemma-26B-A4B-it's text stack with random
weights (only seconds per forward mean anything there).

Source of the numbers: the checkpoint's `config.json` `text_config` as reproduced in several public
configs/test fixtures for DiffusionGemma 26B-A4B and its base Gemma 4 26B-A4B (identical text stacks):
hidden 2816, 30 layers in the pattern 5 sliding (window 1024) + 1 full, 16 query heads,
8 KV heads × head_dim 256 on sliding layers, 2 KV heads × head_dim 512 on full layers (V from
k_proj), dense MLP 2112, 128 experts top-8 of width 704, vocab 262,144, RoPE theta 10k (sliding) and
proportional RoPE theta 1M with partial rotary 0.25 (full), final softcap 30, tied embeddings,
canvas 256. These agree with the figures in docs/DESIGN.md and with HF's config defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealShape:
    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112  # dense MLP (and self-conditioning) width
    num_hidden_layers: int = 30
    sliding_pattern: int = 6  # every 6th layer is full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int = 2
    sliding_window: int = 1024
    num_experts: int = 128
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    canvas_length: int = 256
    max_position_embeddings: int = 262_144

    def layer_types(self) -> list[str]:
        p = self.sliding_pattern
        return [
            "full_attention" if (i + 1) % p == 0 else "sliding_attention"
            for i in range(self.num_hidden_layers)
        ]

    def param_counts(self) -> dict[str, int]:
        """Text-stack parameters (embeddings counted once: tied)."""
        h, e, i = self.hidden_size, self.num_experts, self.moe_intermediate_size
        attn = 0
        for lt in self.layer_types():
            if lt == "full_attention":
                d, kv, v = self.global_head_dim, self.num_global_key_value_heads, 0
            else:
                d, kv, v = self.head_dim, self.num_key_value_heads, 1
            attn += h * d * (2 * self.num_attention_heads + kv * (1 + v))
        n = self.num_hidden_layers
        experts = n * e * 3 * h * i
        dense = n * 3 * h * self.intermediate_size
        router = n * (e * h + h + e)
        embed = self.vocab_size * h
        sc = 3 * h * self.intermediate_size
        return {
            "experts": experts,
            "attention": attn,
            "dense_mlp": dense,
            "router": router,
            "embedding": embed,
            "self_conditioning": sc,
            "total": experts + attn + dense + router + embed + sc,
        }


def real_config(shape: RealShape | None = None):
    """`DiffusionGemmaConfig` at the 26B-A4B shape (imports transformers lazily). The vision tower
    the class always builds is shrunk to a negligible size: the text stack is what we measure."""
    from transformers import DiffusionGemmaConfig

    from canvasq.testbed.config import TINY_VISION

    s = shape or RealShape()
    text = {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "global_head_dim": s.global_head_dim,
        "num_global_key_value_heads": s.num_global_key_value_heads,
        "sliding_window": s.sliding_window,
        "layer_types": s.layer_types(),
        "num_experts": s.num_experts,
        "top_k_experts": s.top_k_experts,
        "moe_intermediate_size": s.moe_intermediate_size,
        "max_position_embeddings": s.max_position_embeddings,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "final_logit_softcapping": 30.0,
    }
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=dict(TINY_VISION),
        canvas_length=s.canvas_length,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
