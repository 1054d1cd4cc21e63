"""One model spec: `ModelShape` and its named instances, and the one `DiffusionGemmaConfig` builder.

    TESTBED        the committed 9 M testbed (models/testbed): every structural feature of the
                   real checkpoint at a size that trains in minutes; canvas 32
    REAL_26B_A4B   google/diffusiongemma-26B-A4B-it's text stack (`random:26b-a4b`: random weights,
                   only seconds per forward mean anything there)
    toy_shape()    every structural feature at toy size, for tests and CPU smoke runs

Both keep: sliding and full attention layers (a full one every `full_every` layers; the sliding window
is shorter than prompt + answer, so band masks matter), full layers with their own head dim and KV
heads and V = K, a dense MLP beside routed experts (the expert width is not a multiple of 128),
self-conditioning, tied embeddings and the final logit softcap 30.

REAL_26B_A4B's numbers are the checkpoint's `config.json` `text_config` (identical to its base, Gemma 4
26B-A4B): hidden 2816, 30 layers (5 sliding with window 1024, then 1 full), 16 query heads, 8 KV heads
× head_dim 256 on sliding layers, 2 KV heads × head_dim 512 on full layers, dense MLP 2112, 128
experts top-8 of width 704, vocab 262,144, RoPE theta 10k (sliding) and proportional RoPE theta 1M
with partial rotary 0.25 (full). The testbed keeps HF's RoPE
defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Special token ids of both models (HF DiffusionGemma's defaults).
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

# The encoder class always builds Gemma 4's vision tower; nothing here feeds it images, so it is shrunk
# to a few thousand parameters instead of the default 150 M.
TINY_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "patch_size": 4,
    "position_embedding_size": 16,
}

_REAL_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP (and self-conditioning) width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int  # full-attention layers: own head dim ...
    num_global_key_value_heads: int  # ... own KV heads, V = K
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    max_position_embeddings: int
    full_every: int  # layer i is full attention when (i + 1) % full_every == 0
    real_rope: bool = False  # the checkpoint's RoPE (proportional on full layers); else HF's defaults

    def replace(self, **changes) -> ModelShape:
        return dataclasses.replace(self, **changes)

    def layer_types(self) -> list[str]:
        p = self.full_every
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


TESTBED = ModelShape(
    vocab_size=768,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    sliding_window=64,
    num_experts=16,
    top_k_experts=4,
    moe_intermediate_size=64,
    canvas_length=32,
    max_position_embeddings=1024,
    full_every=3,
)

REAL_26B_A4B = ModelShape(
    vocab_size=262_144,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    sliding_window=1024,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    canvas_length=256,
    max_position_embeddings=262_144,
    full_every=6,
    real_rope=True,
)

SHAPES = {"testbed": TESTBED, "26b-a4b": REAL_26B_A4B}


def toy_shape(**overrides) -> ModelShape:
    """Every structural feature at toy size: sliding window 16 is shorter than a prompt plus two
    canvases of 8."""
    toy = TESTBED.replace(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=16,
        num_experts=8,
        top_k_experts=3,
        moe_intermediate_size=24,
        canvas_length=8,
        max_position_embeddings=512,
    )
    return toy.replace(**overrides)


def build_config(shape: ModelShape = TESTBED):
    """The `DiffusionGemmaConfig` of a shape (imports transformers lazily)."""
    from transformers import DiffusionGemmaConfig

    s = shape
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
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
        "tie_word_embeddings": True,
        "final_logit_softcapping": 30.0,
    }
    if s.real_rope:
        text.update(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_parameters=_REAL_ROPE)
    # HF's dataclass configs take extra attributes (the token ids) as **kwargs their signature omits
    return DiffusionGemmaConfig(  # type: ignore[call-arg]
        text_config=text,
        vision_config=dict(TINY_VISION),
        canvas_length=s.canvas_length,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        tie_word_embeddings=True,
    )
