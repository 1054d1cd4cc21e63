"""The text a line's output schema shows the model (issue 36): `format_instruction` renders the schema
and `shown_prompt` places it in the prompt. Stdlib only, on the decoders' floor, so the ground floor
(`core.schemas.parse_line`, which stores the shown prompt at validation) and the testbed's JSON
adapter (`testbed.json_adapter`, which trains on the same text) share one rendering."""

from __future__ import annotations

import json
from typing import Any

SCALARS = ["string", "integer", "number", "boolean", "null"]
# json_object: an object whose values are scalars (a bounded automaton; nested values are refused by
# construction, and the output is always a JSON object)
JSON_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": {"type": SCALARS}}


def format_instruction(schema: dict) -> str:
    """The short, deterministic rendering of a line's output schema that is shown to the model (as a
    hosted API shows it: it counts as input tokens): `JSON` for `json_object`, else `JSON ` and a compact
    skeleton of the schema, e.g. `JSON {"reasoning":string,"answer":integer}` (an optional property is
    `"k"?:`, an enum `"a"|"b"`, an array `[T]`, a list of types `string|null`; bounds and annotations are
    left out). ASCII punctuation and the type names only, beside the schema's own keys and values: the
    testbed's 768-piece vocabulary holds every character of it. `shown_prompt` places it."""
    if schema == JSON_OBJECT:
        return "JSON"
    return f"JSON {_skeleton(schema)}"


def _skeleton(schema: dict) -> str:
    def lit(v: Any) -> str:
        return json.dumps(v, separators=(",", ":"), ensure_ascii=False)

    if "enum" in schema or "const" in schema:
        return "|".join(lit(v) for v in (schema["enum"] if "enum" in schema else [schema["const"]]))
    kind = schema["type"]
    if isinstance(kind, list):
        return "|".join(kind)
    if kind == "object":
        req = set(schema.get("required", []))
        props = schema.get("properties", {}).items()
        return "{" + ",".join(f"{lit(k)}{'' if k in req else '?'}:{_skeleton(v)}" for k, v in props) + "}"
    if kind == "array":
        return f"[{_skeleton(schema['items'])}]"
    return str(kind)


def shown_prompt(prompt: str, schema: dict | None, on: bool = True) -> str:
    """The prompt text the model is given for a line: its own text, and for a line with a schema (`on`:
    `CANVASQ_SCHEMA_IN_PROMPT`) `format_instruction(schema)` on a line of its own before it. Built once,
    at validation (`core.schemas.parse_line`), and stored as the row's prompt: the token budget checked
    there, the worker's `encode_prompt` and `usage.prompt_tokens` all count the same text.

    First, as a system turn would say it: a chat line's turns are joined into one user turn
    (`encode_prompt` applies the chat template to it), which the instruction opens; the testbed's raw
    layout `<bos> prompt <sep>` gets it right after `<bos>`, so the question stays next to `<sep>`
    where the checkpoint reads it. CPU-trained adapters (~390 steps x 16, eval seed 61, 32 rows): the
    JSON working opened with the question's start number in 30 rows with the line first, 1 with it
    after the question, 25 with no line.
    `testbed.json_adapter` trains the same text there."""
    if schema is None or not on:
        return prompt
    return f"{format_instruction(schema)}\n{prompt}"
