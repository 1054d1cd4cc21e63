"""Issue 36 through the stock `openai` client: a batch whose lines carry `response_format` (json_schema
strict with three shapes, json_object) on a real `canvasq serve --with-worker` (SQLite, the trained
testbed on the CPU) completes with every row's content parsing and validating against its line's
schema, and `usage` read by the client (rows with `reasoning_effort` write their working first: the
client reads it as `reasoning_content` and its tokens as `completion_tokens_details.reasoning_tokens`); a batch with an unsupported schema feature fails with the line
named."""

from __future__ import annotations

import io
import json

import jsonschema
from openai import OpenAI
from openai.types.chat import ChatCompletion

from tests.harness.server import ENDPOINT, ServerProcess, cli, free_port, poll, upload
from tests.harness.workers import worker_env

SCHEMAS = {
    "answer": {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    "sign": {
        "type": "object",
        "properties": {"sign": {"enum": ["more", "fewer", "same"]}},
        "required": ["sign"],
        "additionalProperties": False,
    },
    "steps": {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["steps"],
        "additionalProperties": False,
    },
}
JSON_OBJECT = {"type": "object"}  # what a json_object row must be, at least


def _line(cid: str, i: int, fmt: dict) -> dict:
    question = f"Tom has {i + 3} apples and buys {i % 5 + 2} more. How many apples does he have?"
    return {
        "custom_id": cid,
        "method": "POST",
        "url": ENDPOINT,
        "body": {
            "model": "testbed",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": question}],
            "response_format": fmt,
        },
    }


def _fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": SCHEMAS[name]}}


def test_structured_batch_round_trip(tmp_path):
    env = worker_env(
        db_url=f"sqlite:///{tmp_path / 'canvasq.sqlite'}",
        broker_url="redis://127.0.0.1:1/0",
        decode_batch_size=8,
        chunk_size=8,
        extra={"CANVASQ_FILES_DIR": str(tmp_path / "files"), "CANVASQ_METRICS_PORT": str(free_port())},
    )
    key = cli(env, "keys", "create", "--project", "alpha").stdout.strip()
    lines, want = [], {}
    for i in range(8):
        name = [*SCHEMAS, "json_object"][i % 4]
        fmt = {"type": "json_object"} if name == "json_object" else _fmt(name)
        lines.append(_line(f"s-{i}", i, fmt))
        want[f"s-{i}"] = SCHEMAS.get(name, JSON_OBJECT)
    for i in range(2):  # rows that think first: their working, then the document
        lines.append(_line(f"t-{i}", i, _fmt("answer")))
        lines[-1]["body"] |= {"reasoning_effort": "medium", "max_tokens": 192}
        want[f"t-{i}"] = SCHEMAS["answer"]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with ServerProcess(env, tmp_path / "serve.log", with_worker=True) as srv:
        srv.wait_ready(deadline_s=180)
        client = OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        b = client.batches.create(
            input_file_id=upload(client, data).id, endpoint=ENDPOINT, completion_window="24h"
        )
        b = poll(client, b.id, deadline_s=500, server=srv)
        assert b.status == "completed" and b.request_counts.total == 10, b
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        err = client.files.content(b.error_file_id).text if b.error_file_id else ""
        assert b.request_counts.completed == len(out) == 10, err
        for line in out:
            body = ChatCompletion.model_validate(line["response"]["body"])  # the client's own types
            assert body.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(body.choices[0].message.content or ""), want[line["custom_id"]])
            thought = (body.choices[0].message.model_extra or {}).get("reasoning_content")
            details = body.usage.completion_tokens_details if body.usage else None
            if line["custom_id"].startswith("t-"):  # the working apart, its tokens counted
                assert thought and " = " in thought, thought  # arithmetic, as it writes it free
                assert details and 0 < (details.reasoning_tokens or 0) < body.usage.completion_tokens
            else:
                assert thought is None and details is None
        assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
        assert b.usage.input_tokens > 0 and b.model == "testbed"

        bad = dict(SCHEMAS["answer"], properties={"answer": {"type": "integer", "minimum": 0}})
        lines = [
            lines[0],
            _line("bad", 1, {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}),
        ]
        f = client.files.create(
            file=("bad.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
            purpose="batch",
        )
        failed = client.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h")
        assert failed.status == "failed" and [e.line for e in failed.errors.data] == [2]
        assert "keyword 'minimum' is not supported" in failed.errors.data[0].message
