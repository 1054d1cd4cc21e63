"""`response_format` on a batch line (issue 36): json_schema and json_object accepted and carried to the
row (which runs on `official`), every schema feature the canvas constraint does not implement refused by
name with the line number, and a schema whose shortest document does not fit max_tokens refused."""

from __future__ import annotations

import json

from click.testing import CliRunner
from sqlalchemy import select

from canvasq.cli import cli
from canvasq.core.schemas import Limits, parse_line
from canvasq.core.settings import Settings
from canvasq.core.store import Store
from canvasq.core.tables import Request
from canvasq.decoders.schema_text import JSON_OBJECT, format_instruction, shown_prompt
from tests.harness.backends import model_for_tests

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _line(cid: str, fmt, **extra) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Ann has 5 pens. How many pens?"}],
        "response_format": fmt,
    }
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body | extra}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": schema}}


def test_formats_carried_to_the_job_on_official():
    limits = Limits.for_model(Settings(model=model_for_tests()))
    job, errors = parse_line(_line("a", _schema(ANSWER), max_tokens=32), 1, limits)
    assert errors == [] and job is not None and job.response_format == ANSWER and job.decoder == "official"
    job, errors = parse_line(_line("b", {"type": "json_object"}, max_tokens=32), 2, limits)
    assert errors == [] and job is not None and job.response_format == JSON_OBJECT
    job, errors = parse_line(_line("c", {"type": "text"}), 3, limits)
    assert errors == [] and job is not None and job.response_format is None and job.decoder is None
    simple = {"custom_id": "d", "prompt": "2 + 2?", "max_tokens": 32, "response_format": _schema(ANSWER)}
    job, errors = parse_line(simple, 4, limits)
    assert errors == [] and job is not None and job.response_format == ANSWER


def test_reasoning_effort_lets_a_constrained_row_think_first():
    """`reasoning_effort` low / medium / high on a line with a schema: the row thinks first (Job.think);
    none / minimal: it does not; another value, or a thinking effort on a free-text row, is refused."""
    limits = Limits.for_model(Settings(), model_for_tests())
    for effort, think in (("medium", True), ("high", True), ("minimal", False), (None, False)):
        job, errors = parse_line(
            _line("a", _schema(ANSWER), max_tokens=64, reasoning_effort=effort), 1, limits
        )
        assert not errors and job is not None and job.think is think, (effort, errors)
    _, errors = parse_line(_line("b", _schema(ANSWER), max_tokens=64, reasoning_effort="lots"), 2, limits)
    assert errors == ["body.reasoning_effort 'lots' is not one of none, minimal, low, medium, high, xhigh"]
    _, errors = parse_line(_line("c", {"type": "text"}, reasoning_effort="low"), 3, limits)
    assert len(errors) == 1 and "already holds its working" in errors[0], errors
    simple = {"custom_id": "d", "prompt": "Ann has 5 pens.", "response_format": _schema(ANSWER)}
    job, errors = parse_line(simple | {"reasoning_effort": "low", "max_tokens": 64}, 4, limits)
    assert not errors and job is not None and job.think


def test_the_schema_is_rendered_short_and_in_order():
    assert format_instruction(ANSWER) == 'JSON {"answer":integer}'
    assert format_instruction(JSON_OBJECT) == "JSON"
    worked = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "change": {"enum": ["gained", "lost", "same"]}},
        "required": ["reasoning", "change"],
        "additionalProperties": False,
    }
    assert format_instruction(worked) == 'JSON {"reasoning":string,"change":"gained"|"lost"|"same"}'
    nested = {
        "type": "object",
        "title": "ignored",
        "properties": {
            "tags": {"type": "array", "items": {"type": ["string", "null"]}, "maxItems": 3},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "ok": {"const": True}},
                "required": ["x"],
            },
            'say "hi"': {"type": "boolean"},
        },
        "required": ["tags"],
    }
    assert format_instruction(nested) == (
        'JSON {"tags":[string|null],"point"?:{"x":number,"ok"?:true},"say \\"hi\\""?:boolean}'
    )


def test_the_job_prompt_shows_the_schema_and_the_setting_turns_it_off():
    text = "Ann has 5 pens. How many pens?"
    for fmt, tag in ((_schema(ANSWER), 'JSON {"answer":integer}'), ({"type": "json_object"}, "JSON")):
        on = Limits.for_model(Settings(model=model_for_tests()))
        job, errors = parse_line(_line("a", fmt, max_tokens=32), 1, on)
        assert errors == [] and job is not None and job.prompt == f"{tag}\n{text}"
        assert job.prompt == shown_prompt(text, job.response_format)
        off = Limits.for_model(Settings(model=model_for_tests(), schema_in_prompt=False))
        job, errors = parse_line(_line("a", fmt, max_tokens=32), 1, off)
        assert errors == [] and job is not None and job.prompt == text
    job, _ = parse_line(_line("t", {"type": "text"}), 1, on)  # no schema: the prompt as written
    assert job is not None and job.prompt == text


def test_the_testbed_vocabulary_holds_every_rendered_character():
    from tokenizers import Tokenizer

    from canvasq.testbed.json_adapter import DEFAULT_MODEL, FORM_SCHEMAS

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    unk = tok.token_to_id("<unk>")
    for schema in [*FORM_SCHEMAS.values(), JSON_OBJECT]:
        text = format_instruction(schema)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert unk not in ids and tok.decode(ids) == text, text
        assert len(ids) <= 48  # short: the testbed's context is 1,024 positions (worked_change: 46)


def test_unsupported_features_refused_with_the_line(service_env, tmp_path):
    nested = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "format": "email"}}},
    }
    lines = [
        _line("ok", _schema(ANSWER), max_tokens=32),
        _line(
            "pattern", _schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}})
        ),
        _line("nested", _schema(nested)),
        _line("ref", _schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}})),
        _line("extra", _schema({"type": "object", "properties": {}, "additionalProperties": True})),
        _line("root", _schema({"type": "array", "items": {"type": "integer"}})),
        _line("kind", {"type": "xml"}),
        _line("short", _schema(ANSWER), max_tokens=4),
        _line("pipe", _schema(ANSWER), max_tokens=32) | {"decoder": "pipe"},
    ]
    path = tmp_path / "fmt.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(cli, ["run", str(path), "-o", str(tmp_path / "o.jsonl")], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    err = res.stderr
    assert "line 1:" not in err
    for line_no, needle in (
        (2, "body.response_format.json_schema.schema.properties.a: keyword 'pattern' is not supported"),
        (
            3,
            "body.response_format.json_schema.schema.properties.items.items: keyword 'format' is not supported",
        ),
        (4, "body.response_format.json_schema.schema.properties.a: keyword '$ref' is not supported"),
        (5, "body.response_format.json_schema.schema: additionalProperties must be false"),
        (6, "body.response_format.json_schema.schema: the root must be an object"),
        (7, "body.response_format.type 'xml'"),
        (
            8,
            "body.response_format: the shortest valid document takes 11 tokens with its end, more than max_tokens 4",
        ),
        (9, "body.response_format is supported by the official decoder only, not 'pipe'"),
    ):
        assert sum(f"line {line_no}: " in x for x in err.splitlines()) == 1, err
        assert f"line {line_no}: {needle}" in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_the_schema_is_stored_with_its_row(service_env, tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(_line("a", _schema(ANSWER), max_tokens=32)) + "\n")
    res = CliRunner().invoke(
        cli, ["submit", str(path), "--queue", service_env["queue"]], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output + res.stderr
    store = Store(service_env["url"])
    try:
        with store.Session() as s:
            run_id, schema, decoder, prompt = s.execute(
                select(Request.run_id, Request.response_format, Request.decoder, Request.prompt)
            ).one()
        assert (schema, decoder) == (ANSWER, "official")
        assert prompt == 'JSON {"answer":integer}\nAnn has 5 pens. How many pens?'  # what the model is given
        claimed = store.claim_chunk(store.pending_chunks(run_id)[0], "w", 60, 3)
        assert [r.response_format for r in claimed.requests] == [ANSWER]  # what the worker decodes
    finally:
        store.dispose()
