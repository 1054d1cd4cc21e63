"""The testbed's vocabulary layout: special token ids shared by its tokenizer and the model config.
Its shape is `canvasq.model.shapes.TESTBED` (the one model spec)."""

from __future__ import annotations

from canvasq.model.shapes import BOS_ID, EOS_ID, PAD_ID

UNK_ID, SEP_ID = 3, 4
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<sep>"]

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SEP_ID", "SPECIAL_TOKENS", "UNK_ID"]
