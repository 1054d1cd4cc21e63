"""`response_format` of a batch line (OpenAI's chat-completions parameter), as canvasq reads it: `text`
(no constraint), `json_object` or `json_schema` (with or without `strict`: canvasq always holds the
output to the schema). What the decoder is given is one JSON schema (`json_object` is the flat object of
scalar values, `JSON_OBJECT`); the schema's features are checked here and anything the canvas
constraint does not implement is refused by name (`schema_problems`), never ignored. Every finished row
is validated against its schema again on output (`decoders.structured.output_problem`, jsonschema)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canvasq.decoders.schema_text import JSON_OBJECT, SCALARS

_TYPES = {"object", "array", *SCALARS}
_ANNOTATIONS = {"title", "description", "$schema", "$comment", "examples"}  # change nothing generated
_KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength"},
    "integer": {"type"},
    "number": {"type"},
    "boolean": {"type"},
    "null": {"type"},
}
MAX_ITEMS = 64  # a bound on minItems / maxItems / minLength / maxLength (the automaton grows with them)
MAX_DEPTH = 6


def parse_response_format(value: Any) -> tuple[dict | None, list[str]]:
    """(the schema the output must follow, or None for `text`; errors naming the field)."""
    if not isinstance(value, dict):
        return None, ["body.response_format must be an object"]
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        return None, [f"body.response_format has unknown fields {sorted(extra)}"]
    if kind == "text":
        return None, []
    if kind == "json_object":
        return JSON_OBJECT, []
    if kind != "json_schema":
        return None, [f"body.response_format.type {kind!r}: expected text, json_object or json_schema"]
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return None, ["body.response_format.json_schema.schema must be an object (the JSON schema)"]
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        return None, [f"body.response_format.json_schema has unknown fields {sorted(unknown)}"]
    schema = spec["schema"]
    problems = schema_problems(schema)
    if not problems and schema.get("type") != "object":
        problems = [": the root must be an object (type: object)"]
    return schema, [f"body.response_format.json_schema.schema{p}" for p in problems]


def schema_problems(schema: Any, path: str = "", depth: int = 0) -> list[str]:
    """Each unsupported or malformed part of `schema`, as `<path>: why` (empty: supported)."""
    if depth > MAX_DEPTH:
        return [f"{path}: nested deeper than {MAX_DEPTH} levels"]
    if not isinstance(schema, dict):
        return [f"{path}: a schema must be an object"]
    where = path
    if "enum" in schema or "const" in schema:
        return _literal_problems(schema, where)
    if "type" not in schema:
        other = sorted(set(schema) - _ANNOTATIONS)
        why = f"keyword {other[0]!r} is not supported" if other else "a schema needs type, enum or const"
        return [f"{where}: {why}"]
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or any(not isinstance(k, str) or k not in _TYPES for k in kinds):
        return [f"{where}: type {json.dumps(kind)} is not supported (one of {sorted(_TYPES)}, or enum/const)"]
    if len(kinds) > 1 and not set(kinds) <= set(SCALARS):
        return [f"{where}: a list of types may hold only scalar types"]
    allowed = set().union(*(_KEYWORDS[str(k)] for k in kinds)) | _ANNOTATIONS
    out = [f"{where}: keyword {k!r} is not supported" for k in sorted(set(schema) - allowed)]
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        v = schema.get(key)
        if key in schema and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ITEMS):
            out.append(f"{where}: {key} must be an integer from 0 to {MAX_ITEMS}")
    if "object" in kinds:
        out += _object_problems(schema, path, depth)
    if "array" in kinds:
        if "items" not in schema:
            out.append(f"{where}: an array needs items")
        else:
            out += schema_problems(schema["items"], f"{path}.items", depth + 1)
    return out


def _literal_problems(schema: dict, where: str) -> list[str]:
    extra = set(schema) - {"enum", "const", "type"} - _ANNOTATIONS
    if extra:
        return [f"{where}: keyword {min(extra)!r} is not supported beside enum/const"]
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not values:
        return [f"{where}: enum must be a non-empty list"]
    if any(isinstance(v, dict | list) for v in values):
        return [f"{where}: enum and const values must be strings, numbers, booleans or null"]
    return []


def _object_problems(schema: dict, path: str, depth: int) -> list[str]:
    where, out = path, []
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return [f"{where}: properties must be an object"]
    required = schema.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        out.append(f"{where}: required must list names of its properties")
    extra = schema.get("additionalProperties", False)
    if extra is not False:
        out.append(f"{where}: additionalProperties must be false (json_object asks for a free object)")
    for name, sub in props.items():
        out += schema_problems(sub, f"{path}.properties.{name}", depth + 1)
    return out


def line_response_format(
    value: Any, decoder: str | None, max_tokens: int, min_tokens: Callable[[dict], int] | None
) -> tuple[dict | None, str | None, list[str]]:
    """A line's `response_format` checked: (its schema or None, the line's decoder, errors). A constrained
    line runs on `official` (the one decoder with the canvas constraint): a line naming another is
    refused, one naming none (or auto) gets official. `min_tokens(schema)`: the shortest document's
    tokens with EOS (`decoders.structured.Grammar.min_tokens`), checked against max_tokens."""
    if value is None:
        return None, decoder, []
    schema, errors = parse_response_format(value)
    if schema is None or errors:
        return None, decoder, errors
    if decoder not in (None, "auto", "official"):
        return (
            None,
            decoder,
            [f"body.response_format is supported by the official decoder only, not {decoder!r}"],
        )
    if min_tokens is not None:
        try:
            need = min_tokens(schema)
        except Exception as exc:  # noqa: BLE001 - a schema the compiler refuses is a line error
            return None, decoder, [f"body.response_format: the schema cannot be compiled ({exc})"]
        if need > max_tokens:
            why = f"the shortest valid document takes {need} tokens with its end, more than max_tokens"
            return None, decoder, [f"body.response_format: {why} {max_tokens}"]
    return schema, "official", []


# OpenAI's `reasoning_effort`: with a response_format, any effort above "minimal" lets the row write free
# text (its working) before its document, kept apart as its reasoning (`decoders.structured.THINK`); the
# level does not bound the thought (max_tokens does)
EFFORTS_THINK = ("low", "medium", "high", "xhigh")
EFFORTS = ("none", "minimal", *EFFORTS_THINK)


def line_think(effort: str | None, schema: dict | None) -> tuple[bool, list[str]]:
    """A line's `reasoning_effort` checked: (whether the row thinks before its document, errors)."""
    if effort is None:
        return False, []
    if effort not in EFFORTS:
        return False, [f"body.reasoning_effort {effort!r} is not one of {', '.join(EFFORTS)}"]
    if effort in EFFORTS_THINK and schema is None:
        why = "a free-text row's answer already holds its working; use it with response_format json_schema"
        return False, [f"body.reasoning_effort={effort!r}: {why}"]
    return effort in EFFORTS_THINK, []


def schema_min_tokens(spec: str) -> Callable[[dict], int] | None:
    """For a model spec: a schema's shortest document in its tokens, EOS included (the schema compiled
    over the model's `tokenizer.json`, once per distinct schema), or None without a tokenizer file."""
    from canvasq.model.loading import DEFAULT_MODEL_DIR

    path = (DEFAULT_MODEL_DIR if spec.startswith("random:") else Path(spec)) / "tokenizer.json"
    if not path.is_file():
        return None

    def count(schema: dict) -> int:
        from canvasq.decoders.structured import cached_grammar, token_texts

        return cached_grammar(schema, token_texts(str(path))).min_tokens

    return count
