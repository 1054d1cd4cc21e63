"""The committed testbed checkpoint: loads offline, matches the testbed shape, tokenizer agrees."""

import json
import os
import subprocess
import sys

import pytest

from canvasq.model.loading import DEFAULT_MODEL_DIR
from canvasq.model.shapes import TESTBED
from canvasq.testbed import config as tb
from canvasq.testbed import tasks

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(), reason="no checkpoint")


def test_loads_offline_with_from_pretrained():
    code = (
        "from transformers import DiffusionGemmaForBlockDiffusion, AutoTokenizer\n"
        f"m = DiffusionGemmaForBlockDiffusion.from_pretrained({str(DEFAULT_MODEL_DIR)!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(DEFAULT_MODEL_DIR)!r})\n"
        "print(type(m).__name__, m.config.canvas_length, len(t))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    name, canvas, vocab = out.stdout.split()[-3:]
    assert name == "DiffusionGemmaForBlockDiffusion" and int(canvas) == TESTBED.canvas_length
    assert int(vocab) <= TESTBED.vocab_size


def test_structure_matches_the_real_model_features():
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    text = cfg["text_config"]
    assert {"sliding_attention", "full_attention"} <= set(text["layer_types"])
    assert text["layer_types"][-1] == "full_attention"
    assert text["num_experts"] >= 16 and text["top_k_experts"] >= 2
    assert text["moe_intermediate_size"] % 128 != 0
    assert text["tie_word_embeddings"] and text["final_logit_softcapping"] == 30.0
    assert text["sliding_window"] < 100  # shorter than prompt + answer: band masks matter
    assert (DEFAULT_MODEL_DIR / "d2f_adapter" / "adapter_config.json").exists()
    total = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file())
    assert total <= 25 * 1024 * 1024


def test_tokenizer_round_trips_and_special_ids_agree():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (tb.PAD_ID, tb.EOS_ID, tb.BOS_ID)
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["text_config"]
    assert (cfg["pad_token_id"], cfg["eos_token_id"], cfg["bos_token_id"]) == (
        tb.PAD_ID,
        tb.EOS_ID,
        tb.BOS_ID,
    )
    for task in tasks.TASKS:
        for p in tasks.generate(task, 50, seed=2):
            for text in (p.prompt, p.answer):
                ids = tok.encode(text, add_special_tokens=False)
                assert tok.decode(ids) == text
                assert max(ids) < cfg["vocab_size"]
    # digits are always single tokens
    assert len(tok.encode("1234567890", add_special_tokens=False)) == 10


def test_answers_span_several_canvases():
    from statistics import mean

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    canvas = TESTBED.canvas_length
    lengths = [
        len(tok.encode(p.answer, add_special_tokens=False)) + 1 for p in tasks.generate("arith", 200, 4)
    ]
    assert mean(lengths) / canvas >= 2
