"""The testbed tokenizer: byte-level BPE trained on the task corpus, digits always split one per
token (so numbers are spelled the same way everywhere), saved as HF files that `AutoTokenizer`
loads offline. Special ids match the model config (`config.py`)."""

from __future__ import annotations

from pathlib import Path

from canvasq.testbed.config import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID


def corpus(n_per_task: int, seed: int):
    """The train split's problems (the committed tokenizer read the legacy stream 12345 before the
    splits existed: `ledger.LEGACY_TRAINING`)."""
    from canvasq.testbed import tasks

    for task in tasks.TASKS:
        for p in tasks.generate(task, n_per_task, seed, split="train"):
            yield p.prompt
            yield p.answer


def train_tokenizer(out_dir: Path, vocab_size: int, n_per_task: int = 20000, seed: int = 12345):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(n_per_task, seed), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        unk_token=SPECIAL_TOKENS[UNK_ID],
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.model_max_length = 1024
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
