"""One token budget: a line the validator passes is one the decoder takes, and the first line over the
edge is refused at validation with its line number (the rule is `decoders.types.token_budget_error`,
the prompt counted as `ModelBundle.encode_prompt` tokenises it). The real testbed model on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from canvasq.core.models import model_context
from canvasq.core.schemas import Limits, LineError, parse_line, validate_file
from canvasq.core.settings import Settings
from canvasq.decoders import run_batch
from canvasq.decoders.schema_text import shown_prompt
from canvasq.decoders.state import request_error
from canvasq.decoders.types import DecodeBatch, DecodeRequest, token_budget_error
from canvasq.model.loading import load_bundle
from tests.harness.backends import model_for_tests


@pytest.fixture(scope="module")
def bundle():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_bundle(model_for_tests(), device="cpu")
    torch.set_num_threads(n)


def _over(line: int, prompt: int, max_tokens: int, canvases: int, C: int, ctx: int) -> LineError:
    """The refusal of a line whose prompt and canvases need more positions than the context."""
    need = prompt + canvases * C
    return LineError(
        line,
        f"prompt ({prompt} tokens) + max_tokens {max_tokens} rounded up to {canvases} canvases of {C} "
        f"need {need} positions; the model context is {ctx}",
    )


def test_rule_rounds_max_tokens_up_to_whole_canvases():
    assert token_budget_error(992, 32, 32, 1024) is None
    assert token_budget_error(992, 1, 32, 1024) is None
    assert token_budget_error(993, 32, 32, 1024) == (
        "prompt (993 tokens) + max_tokens 32 rounded up to 1 canvases of 32 need 1025 positions; "
        "the model context is 1024"
    )
    assert "rounded up to 2 canvases of 32 need 1056" in token_budget_error(992, 33, 32, 1024)
    assert token_budget_error(10**6, 10**6, 32, None) is None  # context unknown: nothing to check


@pytest.mark.parametrize(
    "text",
    [
        "What is 3 plus 4?",
        "",
        "  spaces  and\ttabs\n\nnewlines ",
        "ünïcødé ✓ 数学 🙂",
        "a <sep> and <bos> and <eos> inside",
        "def f(x):\n    return x * 12345\n",
        "9" * 300,
    ],
)
def test_validator_counts_prompt_ids_as_the_decoder_does(bundle, text):
    counter = Limits.for_model(Settings(model=bundle.spec)).prompt_tokens
    ids = bundle.encode_prompt(text, None)
    assert counter.count(text) == len(ids)
    assert counter.at_most(text) >= len(ids)


def test_context_and_canvas_length_are_the_models(bundle):
    ctx = model_context(bundle.spec)
    assert ctx.positions == bundle.config.get_text_config().max_position_embeddings
    assert ctx.canvas_length == bundle.canvas_length
    random_ctx = model_context("random:testbed")  # load_bundle gives random weights the testbed's tokenizer
    assert (random_ctx.positions, random_ctx.canvas_length) == (ctx.positions, ctx.canvas_length)
    assert random_ctx.prompt_tokens.count("What is 3 plus 4?") == len(
        bundle.encode_prompt("What is 3 plus 4?")
    )


def _prompt_of(counter, n_ids: int) -> str:
    """A prompt the decoder tokenises into exactly `n_ids` ids (the testbed splits digits one by one)."""
    text = "Add up every digit of this number: "
    text += "7" * (n_ids - counter.count(text))
    assert counter.count(text) == n_ids
    return text


def test_a_line_at_the_edge_passes_and_decodes_one_token_more_is_refused_at_its_line(bundle, tmp_path):
    limits = Limits.for_model(Settings(model=bundle.spec))
    ctx, C = limits.context_tokens, limits.canvas_length
    edge = _prompt_of(limits.prompt_tokens, ctx - C)  # prompt + one canvas = every position
    longer = edge + "7"
    lines = [
        {"custom_id": "edge", "prompt": edge, "max_tokens": C},
        {"custom_id": "longer-prompt", "prompt": longer, "max_tokens": C},
        {"custom_id": "more-tokens", "prompt": edge, "max_tokens": C + 1},
        {
            "custom_id": "openai",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": longer}], "max_tokens": 1},
        },
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = validate_file(src, limits)
    assert report.jobs == 1
    assert report.errors == [
        _over(2, ctx - C + 1, C, 1, C, ctx),
        _over(3, ctx - C, C + 1, 2, C, ctx),
        _over(4, ctx - C + 1, 1, 1, C, ctx),
    ]

    # the decoder refuses exactly those, with the same words, and decodes the edge line
    ok = DecodeRequest("edge", bundle.encode_prompt(edge, None), C)
    over = DecodeRequest("longer-prompt", bundle.encode_prompt(longer, None), C)
    assert request_error(bundle, ok) is None
    assert request_error(bundle, over) == report.errors[0].message
    (res,) = run_batch(bundle, DecodeBatch([ok]), decoder="official")
    assert res.error is None and res.prompt_tokens == ctx - C and 0 < len(res.token_ids) <= C


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_the_schema_shown_in_the_prompt_counts_at_validation_in_the_decoder_and_in_usage(bundle, tmp_path):
    limits = Limits.for_model(Settings(model=bundle.spec))
    ctx, C, counter = limits.context_tokens, limits.canvas_length, limits.prompt_tokens
    probe = "Add up every digit of this number: 7"
    tag = counter.count(shown_prompt(probe, ANSWER)) - counter.count(probe)
    edge = _prompt_of(counter, ctx - C - tag)  # with the schema shown: prompt + one canvas = every position
    assert counter.count(shown_prompt(edge, ANSWER)) == ctx - C
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": ANSWER}}
    lines = [
        {"custom_id": "edge", "prompt": edge, "max_tokens": C, "response_format": fmt},
        {"custom_id": "over", "prompt": edge + "7", "max_tokens": C, "response_format": fmt},
        {"custom_id": "plain", "prompt": edge + "7", "max_tokens": C},  # fits: no schema to show
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = validate_file(src, limits)
    assert report.jobs == 2
    assert report.errors == [_over(2, ctx - C + 1, C, 1, C, ctx)]
    off = Limits.for_model(Settings(model=bundle.spec, schema_in_prompt=False))
    assert validate_file(src, off).errors == []  # the setting off: the prompt as written

    # the decoder is given the job's prompt: the same count, the same refusal, usage counts the schema
    job, errors = parse_line(lines[0], 1, limits)
    assert errors == [] and job is not None and job.prompt == shown_prompt(edge, ANSWER)
    ok = DecodeRequest("edge", bundle.encode_prompt(job.prompt, None), C, None, job.response_format)
    assert len(ok.prompt_ids) == counter.count(job.prompt) == ctx - C
    over = DecodeRequest(
        "over", bundle.encode_prompt(shown_prompt(edge + "7", ANSWER), None), C, None, ANSWER
    )
    assert request_error(bundle, ok) is None
    assert request_error(bundle, over) == report.errors[0].message
    (res,) = run_batch(bundle, DecodeBatch([ok]), decoder="official")
    assert res.error is None and res.prompt_tokens == ctx - C
    assert isinstance(json.loads(res.text)["answer"], int)
