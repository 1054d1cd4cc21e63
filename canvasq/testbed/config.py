"""The testbed model's shape: DiffusionGemma's structure at a size that trains in minutes.

Every structural feature of the 26B-A4B checkpoint is kept: sliding and full attention layers
(the sliding window is shorter than prompt + answer, so band masks matter), full layers with their
own head dim and KV heads and V = K, a dense MLP beside routed experts (16 experts, top-4, expert
width 64: not a multiple of 128, like the real 704), self-conditioning, tied embeddings and the
final logit softcap. Canvas length 32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Special token ids, shared by the tokenizer and the model config (HF DiffusionGemma's defaults).
PAD_ID, EOS_ID, BOS_ID, UNK_ID, SEP_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<sep>"]


# The encoder class always builds Gemma 4's vision tower; the testbed never feeds it images, so it is
# shrunk to a few thousand parameters instead of the default 150 M.
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


@dataclass(frozen=True)
class TestbedShape:
    vocab_size: int = 768
    hidden_size: int = 256
    intermediate_size: int = 512  # dense MLP and self-conditioning width
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    global_head_dim: int = 128  # full-attention layers: own head dim ...
    num_global_key_value_heads: int = 1  # ... own KV heads, V = K
    sliding_window: int = 64
    num_experts: int = 16
    top_k_experts: int = 4
    moe_intermediate_size: int = 64
    canvas_length: int = 32
    max_position_embeddings: int = 1024


def toy_shape(**overrides) -> TestbedShape:
    """Every structural feature at toy size, for tests and CPU smoke runs: sliding window 16 is
    shorter than a prompt plus two canvases of 8."""
    base = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        sliding_window=16, num_experts=8, top_k_experts=3, moe_intermediate_size=24, canvas_length=8,
        max_position_embeddings=512,
    )
    base.update(overrides)
    return TestbedShape(**base)


def layer_types(n_layers: int) -> list[str]:
    """Two sliding layers then one full, repeated; the last layer is always full (HF requires it)."""
    return ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n_layers)]


def build_config(shape: TestbedShape | None = None):
    """A `DiffusionGemmaConfig` for the testbed shape (imports transformers lazily)."""
    from transformers import DiffusionGemmaConfig

    s = shape or TestbedShape()
    text = dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        global_head_dim=s.global_head_dim,
        num_global_key_value_heads=s.num_global_key_value_heads,
        sliding_window=s.sliding_window,
        layer_types=layer_types(s.num_hidden_layers),
        num_experts=s.num_experts,
        top_k_experts=s.top_k_experts,
        moe_intermediate_size=s.moe_intermediate_size,
        max_position_embeddings=s.max_position_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        tie_word_embeddings=True,
        final_logit_softcapping=30.0,
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=TINY_VISION,  # the class always builds a vision tower: keep it negligible
        canvas_length=s.canvas_length,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        tie_word_embeddings=True,
    )


def shape_dict(shape: TestbedShape | None = None) -> dict:
    return asdict(shape or TestbedShape())
