"""The OpenAI chat-completions request body of a batch line, as canvasq reads it: text messages, the
token limit, stop sequences, and every other parameter honoured or refused by name
(`body_param_errors`), never silently dropped."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def non_text_parts(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.type for p in self.content if p.type != "text"]


class ChatBody(BaseModel):
    """The chat body. Every OpenAI parameter is honoured or refused (`body_param_errors`); none is
    accepted and silently dropped."""

    model_config = ConfigDict(extra="allow")  # extras are judged by `body_param_errors`
    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    metadata: dict[str, StrictStr] | None = None
    response_format: Any = None  # judged by `core.response_format.line_response_format`
    reasoning_effort: StrictStr | None = None  # judged by `core.response_format.line_think`


# Body parameters that change nothing canvasq generates (accepted), and the values of sampling
# parameters that ask for exactly what the decoders already do (anything else is refused).
_BODY_NO_EFFECT = frozenset({"user", "store", "service_tier", "stream_options"})
_BODY_NEUTRAL = {
    "n": 1,
    "top_p": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "stream": False,
    "parallel_tool_calls": None,
}
_BODY_WHY = {
    "n": "canvasq returns one choice per request; write {v} lines with their own custom_ids instead",
    "temperature": "the decoders sample on their own schedule (official: the checkpoint's temperature ramp); "
    "remove it",
    "top_p": "the decoders do not truncate the distribution; only top_p 1 is honoured",
    "seed": "each row draws from its own generator, seeded by CANVASQ_SEED and its custom_id (the same line "
    "gives the same output); a per-request seed is not supported",
}
MAX_STOP = 4  # OpenAI's limit on stop sequences


def body_param_errors(body: ChatBody) -> list[str]:
    """One message per body parameter canvasq cannot honour end to end (refused, never dropped)."""
    out = []
    for name, value in (body.model_extra or {}).items():
        if name in _BODY_NO_EFFECT:
            continue
        neutral = _BODY_NEUTRAL.get(name, ...)
        if value == neutral and isinstance(value, bool) == isinstance(neutral, bool):  # True is not n=1
            continue
        why = _BODY_WHY.get(name, "not supported by canvasq (it would be ignored); remove it")
        out.append(f"body.{name}={json.dumps(value)[:40]}: {why.format(v=value)}")
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stop) > MAX_STOP:
        out.append(f"body.stop has {len(stop)} sequences; the limit is {MAX_STOP}")
    if any(not s for s in stop):
        out.append("body.stop has an empty string")
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        out.append(
            f"body.max_tokens ({body.max_tokens}) and body.max_completion_tokens "
            f"({body.max_completion_tokens}) differ; give one"
        )
    return out
