"""Input lines, jobs and output lines.

Flow: JSONL line → `SimpleLine` | `OpenAILine` (pydantic, line-numbered errors) → `Job` (core, CPU)
→ DecodeBatch (worker) → ForwardInputs (model, GPU). Output rows come back as OpenAI batch output
lines (`core.results.output_line`).

`validate_file` streams the file once in binary, a line at a time with a length cap, so a
100,000-line file costs the set of custom_ids plus one line, never the file. Every error is
collected (up to `max_errors` kept, the rest counted); the caller enqueues nothing unless the
report is clean. File-level errors (empty file) carry line 0.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from canvasq.core.models import PromptTokens, model_context
from canvasq.core.openai_body import MAX_STOP, ChatBody, body_param_errors
from canvasq.core.response_format import line_response_format, line_think, schema_min_tokens
from canvasq.core.settings import DECODERS, RANDOM_MODELS, TASKS, Settings, model_name
from canvasq.decoders.schema_text import shown_prompt
from canvasq.decoders.types import token_budget_error

OPENAI_URLS = ("/v1/chat/completions",)


# ---------------------------------------------------------------------------------------- input forms


# ---------------------------------------------------------------------------------------- task inference

# Code: a Python signature, a docstring or a doctest prompt. Math: a question about a quantity with
# numbers in it (the testbed's word problems, GSM8K's). Anything else has no inferable task and goes
# to the accurate decoder.
_CODE_RE = re.compile(r"^\s*(async\s+)?def\s+\w+\s*\(|^\s*class\s+\w+|\"\"\"|'''|^\s*>>>|^```", re.MULTILINE)
_MATH_ASK_RE = re.compile(
    r"\bhow (many|much)\b|\bwhat is\b|\bcalculate\b|\bcompute\b|\bsolve\b|"
    r"\bhow (old|long|far)\b|\bin total\b|\baltogether\b|[-+*/=] *\d",
    re.IGNORECASE,
)


def infer_task(prompt: str) -> str | None:
    """`code`, `math` or None (not inferable) from a prompt's text: the rule `--decoder auto` routes by
    when a line gives no task."""
    if _CODE_RE.search(prompt):
        return "code"
    numbers = len(re.findall(r"\d+(?:\.\d+)?", prompt))
    if numbers >= 1 and _MATH_ASK_RE.search(prompt):
        return "math"
    return None


class OpenAILine(BaseModel):
    """`{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`."""

    model_config = ConfigDict(extra="forbid")
    custom_id: StrictStr
    method: Literal["POST"]
    url: StrictStr
    body: ChatBody
    # canvasq extensions (not in OpenAI's format): routing hint and decoder choice per line
    task: StrictStr | None = None
    decoder: StrictStr | None = None


class SimpleLine(BaseModel):
    """`{"custom_id", "prompt", "task", "max_tokens", "decoder"?}`."""

    model_config = ConfigDict(extra="forbid")
    custom_id: StrictStr
    prompt: StrictStr
    task: StrictStr | None = None
    max_tokens: StrictInt | None = None
    decoder: StrictStr | None = None
    model: StrictStr | None = None
    stop: StrictStr | list[StrictStr] | None = None
    response_format: Any = None
    reasoning_effort: StrictStr | None = None


@dataclass(frozen=True)
class Job:
    """One validated request (core, CPU side). `prompt` is the text the worker tokenises (with a schema,
    shown before the line's text: `decoders.schema_text.shown_prompt`); `task` is the
    line's own (or its body.metadata's), else inferred from the prompt (`infer_task`), else None."""

    custom_id: str
    prompt: str
    task: str | None
    max_tokens: int
    decoder: str | None  # None: the run's decoder
    line_no: int
    stop: tuple[str, ...] = ()  # stop sequences: the text is cut before the first (finish_reason "stop")
    response_format: dict | None = None  # the JSON schema the output must follow (core.response_format)
    think: bool = False  # the row writes free text before its document (`reasoning_effort`)


# ---------------------------------------------------------------------------------------- validation


class LineErrorCode(StrEnum):
    """What kind of error a line (or the file) has: the Batch API's `errors.data[].code`."""

    invalid_request = "invalid_request"  # a JSON object that is not a request canvasq can run
    invalid_json_line = "invalid_json_line"  # not JSON, or JSON but not an object
    duplicate_custom_id = "duplicate_custom_id"
    empty_file = "empty_file"
    invalid_file = "invalid_file"  # the file itself (line 0): not a regular, readable file


@dataclass(frozen=True)
class LineError:
    line: int
    message: str
    code: LineErrorCode = LineErrorCode.invalid_request

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class ValidationReport:
    path: str
    lines: int = 0
    jobs: int = 0
    errors: list[LineError] = field(default_factory=list)
    errors_dropped: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and self.jobs > 0

    @property
    def error_count(self) -> int:
        return len(self.errors) + self.errors_dropped

    def summary(self) -> str:
        head = f"{self.path}: {self.error_count} error(s) in {self.lines} line(s); nothing was enqueued"
        body = "\n".join(f"  {e}" for e in self.errors)
        more = f"\n  ... and {self.errors_dropped} more" if self.errors_dropped else ""
        return f"{head}\n{body}{more}"


class InputError(Exception):
    """Raised by `load_jobs` / submission when the file has errors; carries the full report."""

    def __init__(self, report: ValidationReport):
        super().__init__(report.summary())
        self.report = report


@dataclass
class Limits:
    """What a line is checked against. Built from settings + the run's model (`Limits.for_model`)."""

    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_custom_id_len: int = 64
    max_line_bytes: int = 1 << 20
    max_errors: int = 200
    context_tokens: int | None = None  # the model's context (prompt + answer)
    canvas_length: int = 1  # the answer is generated in canvases: max_tokens counts rounded up to them
    prompt_tokens: PromptTokens | None = None  # None: the prompt's share of the context is not checked
    model_aliases: frozenset[str] = frozenset()  # accepted values of a line's "model" (empty: any)
    schema_tokens: Callable[[dict], int] | None = None  # a schema's shortest document in tokens, EOS included
    schema_in_prompt: bool = True  # a line's schema shown to the model (`decoders.schema_text.shown_prompt`)

    @classmethod
    def for_model(cls, settings: Settings, model: str | None = None) -> Limits:
        spec = model or settings.model
        ctx = model_context(spec)
        aliases = {spec, model_name(spec), "testbed", *RANDOM_MODELS}
        limit = ctx.positions
        return cls(
            max_tokens_limit=min(settings.max_tokens_limit, limit) if limit else settings.max_tokens_limit,
            default_max_tokens=settings.default_max_tokens,
            max_custom_id_len=settings.max_custom_id_len,
            max_line_bytes=settings.max_line_bytes,
            max_errors=settings.max_errors,
            context_tokens=limit,
            canvas_length=ctx.canvas_length,
            prompt_tokens=ctx.prompt_tokens,
            model_aliases=frozenset(aliases),
            schema_tokens=schema_min_tokens(spec),
            schema_in_prompt=settings.schema_in_prompt,
        )


def prompt_budget_error(prompt: str, max_tokens: int, limits: Limits) -> str | None:
    """The decoders' token budget (`decoders.types.token_budget_error`) checked at validation, with
    the prompt counted as the worker tokenises it."""
    counter, ctx = limits.prompt_tokens, limits.context_tokens
    if counter is None or not ctx:
        return None

    def error(prompt_tokens: int) -> str | None:
        return token_budget_error(prompt_tokens, max_tokens, limits.canvas_length, ctx)

    if error(counter.at_most(prompt)) is None:  # fits even at the bound: no tokenizer pass
        return None
    return error(counter.count(prompt))


def _pydantic_errors(exc: ValidationError) -> list[str]:
    """One readable message per field; union branches (`str`, `list[...]`) are folded together."""
    out, seen = [], set()
    for e in exc.errors(include_url=False):
        parts = [str(p) for p in e["loc"]]
        if any(p in ("str", "int") or "[" in p for p in parts):  # a union branch tag
            parts = parts[: next(i for i, p in enumerate(parts) if p in ("str", "int") or "[" in p)]
            e = {**e, "msg": "wrong type"}
        loc = ".".join(parts) or "line"
        if loc in seen:
            continue
        seen.add(loc)
        kind = e["type"]
        if kind == "missing":
            out.append(f"missing field '{loc}'")
        elif kind == "extra_forbidden":
            out.append(f"unknown field '{loc}'")
        elif kind == "literal_error" and loc == "method":
            out.append(f'method must be "POST", got {e.get("input")!r}')
        else:
            out.append(f"field '{loc}': {e['msg']} (got {type(e.get('input')).__name__})")
    return out


def _storable_text(name: str, value: str) -> list[str]:
    """Text the store and the output file can hold: JSON can spell a NUL (PostgreSQL text refuses it)
    and a lone UTF-16 surrogate (no UTF-8 encoding exists), so both are line errors here."""
    out = []
    if "\x00" in value:
        out.append(f"{name} contains a NUL character (\\u0000 at character {value.index(chr(0)) + 1})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        out.append(
            f"{name} contains a lone surrogate (\\u{ord(value[exc.start]):04x} at character {exc.start + 1}); "
            "not valid Unicode"
        )
    return out


def _not_an_object(obj: Any) -> str:
    return f"expected a JSON object, got {type(obj).__name__}"


def _line_fields(line: OpenAILine | SimpleLine, errors: list[str]):
    """(prompt, max_tokens, model, task, stop) of either input form; the form's own errors are appended."""
    if isinstance(line, SimpleLine):
        if isinstance(line.stop, list) and len(line.stop) > MAX_STOP:
            errors.append(f"stop has {len(line.stop)} sequences; the limit is {MAX_STOP}")
        return line.prompt, line.max_tokens, line.model, line.task, line.stop
    if line.url not in OPENAI_URLS:
        errors.append(f"unknown url {line.url!r}; supported: {', '.join(OPENAI_URLS)}")
    msgs = line.body.messages
    if not any(m.role == "user" for m in msgs):
        errors.append("body.messages has no user turn")
    for i, m in enumerate(msgs):
        if m.non_text_parts():
            errors.append(
                f"body.messages.{i}: only text content is supported (got {m.non_text_parts()[0]!r})"
            )
    prompt = "\n\n".join(m.text() for m in msgs)  # the conversation, in order
    max_tokens = line.body.max_tokens if line.body.max_tokens is not None else line.body.max_completion_tokens
    errors += body_param_errors(line.body)
    task = line.task or (line.body.metadata or {}).get("task")
    return prompt, max_tokens, line.body.model, task, line.body.stop


def _checked_max_tokens(max_tokens: int | None, limits: Limits) -> tuple[int, list[str]]:
    """The line's max_tokens (the default when absent) and why it is out of bounds, if it is."""
    if max_tokens is None:
        return limits.default_max_tokens, []
    if max_tokens <= 0:
        return max_tokens, [f"max_tokens must be positive, got {max_tokens}"]
    if max_tokens > limits.max_tokens_limit:
        why = (
            f"the model's context: {limits.context_tokens} tokens for prompt and answer"
            if limits.context_tokens == limits.max_tokens_limit
            else "CANVASQ_MAX_TOKENS_LIMIT"
        )
        return max_tokens, [f"max_tokens {max_tokens} is beyond the limit {limits.max_tokens_limit} ({why})"]
    return max_tokens, []


def parse_line(obj: Any, line_no: int, limits: Limits) -> tuple[Job | None, list[str]]:
    """Check one decoded JSON value; returns (job, []) or (None, messages)."""
    if not isinstance(obj, dict):
        return None, [_not_an_object(obj)]
    is_openai = any(k in obj for k in ("body", "method", "url"))
    try:
        line = OpenAILine.model_validate(obj) if is_openai else SimpleLine.model_validate(obj)
    except ValidationError as exc:
        return None, _pydantic_errors(exc)

    errors: list[str] = []
    cid = line.custom_id
    if not cid.strip():
        errors.append("custom_id is empty")
    elif len(cid) > limits.max_custom_id_len:
        errors.append(f"custom_id is {len(cid)} characters; the limit is {limits.max_custom_id_len}")

    prompt, max_tokens, model, task, stop = _line_fields(line, errors)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not x for x in stops) and isinstance(line, SimpleLine):
        errors.append("stop has an empty string")
    for i, x in enumerate(stops):
        errors += _storable_text(f"stop[{i}]", x)

    errors += _storable_text("custom_id", cid)
    prompt_errors = _storable_text("prompt", prompt) or ([] if prompt.strip() else ["prompt is empty"])
    errors += prompt_errors
    if task is not None and task not in TASKS:
        errors.append(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if line.decoder is not None and line.decoder not in DECODERS:
        errors.append(f"unknown decoder {line.decoder!r}; known: {', '.join(DECODERS)}")
    if model is not None and limits.model_aliases and model not in limits.model_aliases:
        errors.append(f"unknown model {model!r}; this run serves {min(limits.model_aliases)!r}")

    max_tokens, max_tokens_errors = _checked_max_tokens(max_tokens, limits)
    errors += max_tokens_errors
    fmt = line.response_format if isinstance(line, SimpleLine) else line.body.response_format
    counter = None if max_tokens_errors else limits.schema_tokens
    schema, decoder, fmt_errors = line_response_format(fmt, line.decoder, max_tokens, counter)
    errors += fmt_errors
    effort = line.reasoning_effort if isinstance(line, SimpleLine) else line.body.reasoning_effort
    think, think_errors = line_think(effort, schema)
    errors += think_errors
    shown = shown_prompt(prompt, schema, limits.schema_in_prompt)  # the text the model is given
    if not prompt_errors and not max_tokens_errors:  # what the decoder will see: does it fit its context?
        budget = prompt_budget_error(shown, max_tokens, limits)
        errors += [budget] if budget else []
    if errors:
        return None, errors
    if task is None:
        task = infer_task(prompt)
    return Job(cid, shown, task, max_tokens, decoder, line_no, stops, schema, think), []


def _read_lines(fh, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line_no, raw bytes without newline) or (line_no, None) for an over-long line,
    never holding more than `max_line_bytes` of one line."""
    line_no = 0
    while True:
        raw = fh.readline(max_line_bytes + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while True:  # skip the rest of this line in bounded pieces
                rest = fh.readline(1 << 16)
                if not rest or rest.endswith(b"\n"):
                    break
            yield line_no, None
            continue
        yield line_no, raw.rstrip(b"\r\n")


def input_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be an input file (it is read twice, validated then stored), or None.
    A FIFO or device would block the first open or be empty the second time."""
    import stat

    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: cannot read: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "not a file"
        )
        return f"{path} is {kind}; the input must be a regular file (it is read twice)"
    if not os.access(path, os.R_OK):
        return f"{path}: permission denied"
    return None


def _binary_head(head: bytes, report: ValidationReport) -> str | None:
    """A NUL in the file's first bytes makes it binary (or UTF-16): one error, not one per line of
    garbage, on the NUL's own line when text lines come before it (line 1 otherwise)."""
    if b"\x00" not in head:
        return None
    offset = head.index(b"\x00")
    start = head.rfind(b"\n", 0, offset) + 1
    try:
        head[:start].decode("utf-8")
        report.lines = head.count(b"\n", 0, offset) + 1
    except UnicodeDecodeError:
        report.lines = 1
    return f"binary data (NUL byte at byte offset {offset}); expected UTF-8 JSON lines"


def _json_object(raw: bytes | None, line_no: int, max_line_bytes: int):
    """(the line's JSON object, None) or (None, (message, code)): too long, binary, not UTF-8, blank,
    malformed or not an object."""
    bad = LineErrorCode.invalid_request
    if raw is None:
        return None, (f"line is longer than {max_line_bytes} bytes", bad)
    if b"\x00" in raw:
        return None, ("binary data (NUL byte); expected UTF-8 JSON lines", bad)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, (f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})", bad)
    if text.startswith("\ufeff") and line_no == 1:
        text = text[1:]
    if not text.strip():
        return None, ("blank line; every line must be one JSON request", bad)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, (f"malformed JSON: {exc.msg} (column {exc.colno})", LineErrorCode.invalid_json_line)
    except RecursionError:
        return None, ("JSON nested too deeply", bad)
    if not isinstance(obj, dict):
        return None, (_not_an_object(obj), LineErrorCode.invalid_json_line)
    return obj, None


def iter_validated(path: str | Path, limits: Limits, report: ValidationReport) -> Iterator[Job]:
    """Stream `path`, yielding valid Jobs and recording every error in `report`."""
    seen: dict[str, int] = {}  # custom_id -> first line: the only state that grows with the file

    def err(line: int, msg: str, code: LineErrorCode = LineErrorCode.invalid_request) -> None:
        if len(report.errors) < limits.max_errors:
            report.errors.append(LineError(line, msg, code))
        else:
            report.errors_dropped += 1

    problem = input_file_problem(path)
    if problem:
        err(0, problem, LineErrorCode.invalid_file)
        return
    with open(path, "rb") as fh:
        binary = _binary_head(fh.read(8192), report)
        if binary:
            err(report.lines, binary)
            return
        fh.seek(0)
        for line_no, raw in _read_lines(fh, limits.max_line_bytes):
            report.lines = line_no
            obj, problem = _json_object(raw, line_no, limits.max_line_bytes)
            if obj is None:
                err(line_no, *problem)
                continue
            job, msgs = parse_line(obj, line_no, limits)
            for m in msgs:
                err(line_no, m)
            cid = obj.get("custom_id")
            if isinstance(cid, str) and cid:
                first = seen.get(cid)
                if first is not None:
                    err(
                        line_no,
                        f"duplicate custom_id {cid!r} (first on line {first})",
                        LineErrorCode.duplicate_custom_id,
                    )
                    job = None
                else:
                    seen[cid] = line_no
            if job is not None:
                report.jobs += 1
                yield job
    if report.lines == 0:
        err(0, "file is empty: no requests", LineErrorCode.empty_file)


def validate_file(path: str | Path, limits: Limits) -> ValidationReport:
    """One streaming pass; the report lists every error (nothing is kept but ids and errors)."""
    report = ValidationReport(str(path))
    for _ in iter_validated(path, limits, report):
        pass
    return report


def iter_jobs(path: str | Path, limits: Limits) -> Iterator[Job]:
    """Jobs of a file already validated clean; raises InputError if it changed underneath."""
    report = ValidationReport(str(path))
    yield from iter_validated(path, limits, report)
    if report.errors or report.errors_dropped:
        raise InputError(report)
