"""The JSON adapter's data and merge (canvasq/testbed/json_adapter.py): its documents are exactly what
the constrained decoder can write (the schema's automaton walks their tokens to the end), drawn from
the train split only; its pool rows are laid out like the checkpoint's; a merged adapter changes the
official decoder's weights by the LoRA's product."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from canvasq.decoders.structured import compile_grammar, split_thought, token_texts
from canvasq.testbed import json_adapter as ja
from canvasq.testbed import tasks
from canvasq.testbed.config import BOS_ID, EOS_ID, PAD_ID, SEP_ID

TESTBED = ja.DEFAULT_MODEL


SCHEMAS = ja.FORM_SCHEMAS  # the schemas benchmarks/structured_output.py holds the forms' questions to


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(TESTBED))


@pytest.mark.parametrize("form", [f for f in ja.FORMS if f in SCHEMAS])
def test_each_json_form_is_a_document_the_constrained_decoder_can_write(tok, form):
    texts = token_texts(str(TESTBED / "tokenizer.json"))
    think = form.startswith("think")  # the working first, then the document (a line's reasoning_effort)
    grammar = compile_grammar(SCHEMAS[form], texts, think=think)
    for p in tasks.generate("arith", 12, 5, split="train"):
        text = ja.FORMS[form](p)
        thought, doc = split_thought(text) if think else ("", text)
        assert thought == (p.answer if think else "")
        jsonschema.validate(json.loads(doc), SCHEMAS[form])
        ids = tok.encode(text, add_special_tokens=False)
        # the automaton takes the tokenizer's own ids, and the document ends there (EOS to `done`)
        assert grammar.walk(grammar.start, [*ids, texts.eos]) == grammar.done, text


def test_the_forms_carry_the_working_and_the_right_answers():
    for p in tasks.generate("arith", 40, 6, split="train"):
        worked = json.loads(ja.FORMS["worked"](p))
        assert worked["answer"] == p.target
        assert p.answer == worked["reasoning"] + f"\n#### {p.target}"  # the free working, whole
        start = int(p.prompt.split(" has ")[1].split()[0])
        assert json.loads(ja.FORMS["change"](p))["change"] == (
            "gained" if p.target > start else "lost" if p.target < start else "same"
        )
        assert ja.FORMS["free"](p) == p.answer


def test_training_texts_come_from_the_train_split_in_the_weighted_forms():
    weights = ja.parse_weights("free=1,worked=3")
    rows = ja.training_texts(400, 20, 0, weights)
    assert all(tasks.split_of(re.sub(r"^JSON [^\n]*\n", "", prompt)) == "train" for prompt, _, _ in rows)
    forms = [f for _, _, f in rows]
    assert forms.count("code") == 20 and set(forms) == {"free", "worked", "code"}
    assert 0.65 < forms.count("worked") / 400 < 0.85
    assert ja.training_texts(400, 20, 0, weights) == rows  # deterministic per seed


def test_each_json_form_prompt_carries_its_schema_as_the_service_shows_it():
    from canvasq.core.schemas import Limits, parse_line
    from canvasq.core.settings import Settings
    from canvasq.decoders.schema_text import format_instruction, shown_prompt

    rows = ja.training_texts(300, 10, 1, ja.parse_weights(ja.DEFAULT_WEIGHTS))
    problems = {p.prompt: p for p in tasks.generate("arith", 300, 1, split="train")}
    limits = Limits.for_model(Settings(model=str(TESTBED)))
    assert {f for _, _, f in rows} == {*ja.parse_weights(ja.DEFAULT_WEIGHTS), "code"}
    for prompt, answer, form in rows:
        if form in ("free", "code"):
            assert "JSON" not in prompt and (form == "code" or prompt in problems)
            continue
        tag, problem = prompt.split("\n", 1)
        assert problem in problems and tag == format_instruction(SCHEMAS[form])
        assert prompt == shown_prompt(problem, SCHEMAS[form])
        fmt = {"type": "json_schema", "json_schema": {"name": form, "strict": True, "schema": SCHEMAS[form]}}
        job, errors = parse_line({"custom_id": "x", "prompt": problem, "response_format": fmt}, 1, limits)
        assert errors == [] and job is not None and job.prompt == prompt  # the service's own prompt
        jsonschema.validate(json.loads(answer), SCHEMAS[form])
    plain = ja.training_texts(300, 10, 1, ja.parse_weights(ja.DEFAULT_WEIGHTS), tagged=False)
    assert [r[1:] for r in plain] == [r[1:] for r in rows] and not any("JSON" in r[0] for r in plain)


def test_weights_refuse_unknown_forms_and_empty_shares():
    assert ja.parse_weights("free=1,answer=1") == {"free": 0.5, "answer": 0.5}
    for bad in ("free=1,prose=1", "free=0", "", "free=-1,worked=2"):
        with pytest.raises(ValueError):
            ja.parse_weights(bad)


def test_pool_rows_are_prompt_then_answer_then_eos_in_whole_canvases(tok):
    rows = [("Ann has 3 cups.", '{"answer":3}', "answer"), ("Ben has 12 pens. How many?", "x " * 40, "free")]
    seq, plen, ncan = ja.build_pool(rows, tok, 32)
    for i, (prompt, answer, _) in enumerate(rows):
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False)
        assert plen[i] == len(p) + 2 and ncan[i] == -(-(len(a) + 1) // 32)
        row = seq[i].tolist()
        assert row[: plen[i]] == [BOS_ID, *p, SEP_ID]
        assert row[plen[i] : plen[i] + len(a) + 1] == [*a, EOS_ID]
        assert set(row[plen[i] + len(a) + 1 :]) <= {PAD_ID}
    assert seq.shape[1] >= max(plen) + max(ncan) * 32


def test_the_cli_documents_both_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        ja.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "merge" in out and "split" in out


def test_an_applied_adapter_adds_its_lora_product_to_the_plain_weights(tmp_path: Path):
    from peft import LoraConfig, get_peft_model

    from canvasq.model.loading import load_bundle

    bundle = load_bundle(str(TESTBED))
    name = "model.decoder.layers.0.self_attn.q_proj"
    before = dict(bundle.hf_model.named_modules())[name].weight.detach().clone()
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=ja.TARGETS)
    peft_model = get_peft_model(load_bundle(str(TESTBED)).hf_model, lora_config)
    torch.manual_seed(0)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "ad"))
    ja.apply_adapter(bundle, tmp_path / "ad")
    after = dict(bundle.hf_model.named_modules())[name].weight.detach()
    mods = dict(peft_model.named_modules())
    lora = mods["base_model.model." + name]
    delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * (8 / 4)
    assert torch.allclose(after - before, delta, atol=1e-5)
    assert not torch.equal(after, before)


def test_training_shares_the_lora_with_the_encoder_and_saves_decoder_keys(tmp_path: Path):
    """The merge changes the encoder too (shared tensors): training runs it through the same LoRA, and
    the saved adapter keeps only the decoder's keys (what the merge targets)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from canvasq.model.loading import load_bundle

    peft_model = get_peft_model(
        load_bundle(str(TESTBED)).hf_model, LoraConfig(r=2, lora_alpha=4, target_modules=ja.TARGETS)
    )
    model = peft_model.base_model.model
    enc, dec = model.model.encoder.language_model.layers[1], model.model.decoder.layers[1]
    plain = enc.mlp.up_proj
    restore = ja.share_with_encoder(model)
    assert enc.mlp.up_proj is dec.mlp.up_proj and hasattr(enc.self_attn.q_proj, "lora_A")
    restore()
    assert enc.mlp.up_proj is plain
    peft_model.save_pretrained(str(tmp_path / "ad"))
    keys = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    assert keys and all(".decoder.layers." in k for k in keys)


def test_the_committed_think_adapter_copies_its_answer_into_the_document():
    """models/adapters/testbed_json_think (the `think` form, CPU-trained): a row with a schema and
    `think` writes its working, `#### N`, then {"answer": N}; on 8 eval problems the document's number
    is the working's in at least 6 (586 of 600 in BENCHMARKS.md's run)."""
    from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
    from canvasq.model.loading import load_bundle

    bundle = ja.apply_adapter(load_bundle(), Path(__file__).parents[2] / "models/adapters/testbed_json_think")
    schema = SCHEMAS["answer"]
    problems = tasks.generate("arith", 8, 61, split="eval")
    reqs = [
        DecodeRequest(
            p.uid,
            bundle.encode_prompt(ja.form_prompt(p.prompt, "think"), "arith"),
            192,
            "arith",
            schema,
            True,
        )
        for p in problems
    ]
    copied = 0
    for r in run_batch(
        bundle, DecodeBatch(reqs, seed=61), decoder="official", overrides={"cuda_graphs": "off"}
    ):
        assert r.error is None and r.reasoning is not None, r
        jsonschema.validate(json.loads(r.text), schema)
        m = re.search(r"#### (-?\d+)", r.reasoning)
        copied += m is not None and json.loads(r.text)["answer"] == int(m.group(1))
    assert copied >= 6, copied
