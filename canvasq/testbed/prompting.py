"""How the testbed lays out a prompt: `<bos> prompt-text <sep>`; the answer follows in canvases and
ends with `<eos>`, the rest of its last canvas padded with `<pad>` (what HF's sampler writes after
EOS)."""

from __future__ import annotations

from canvasq.testbed.config import BOS_ID, SEP_ID


def encode_prompt(tokenizer, text: str) -> list[int]:
    return [BOS_ID, *tokenizer.encode(text, add_special_tokens=False), SEP_ID]
