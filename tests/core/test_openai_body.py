"""OpenAI body parameters are honoured or refused by name at validation, never dropped."""

from __future__ import annotations

import pytest

from canvasq.core.schemas import Limits, parse_line


def _line(**body):
    return {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], **body},
    }


@pytest.mark.parametrize(
    "param,value", [("temperature", 0.5), ("n", 2), ("top_p", 0.9), ("seed", 7), ("logit_bias", {"1": 2})]
)
def test_a_parameter_canvasq_cannot_honour_is_refused_by_name(param, value):
    job, errors = parse_line(_line(**{param: value}), 3, Limits())
    assert job is None and len(errors) == 1 and errors[0].startswith(f"body.{param}=")


@pytest.mark.parametrize(
    "param,value", [("n", 1), ("top_p", 1), ("user", "u"), ("max_completion_tokens", 32)]
)
def test_neutral_parameters_are_accepted(param, value):
    job, errors = parse_line(_line(**{param: value}), 3, Limits())
    assert errors == [] and job is not None and job.prompt == "hi"
