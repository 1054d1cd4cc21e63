"""Results export: OpenAI batch output lines from a run's terminal rows, shared by `canvasq results`,
`canvasq run` and the Batch API's output files (change the line format in one place)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from canvasq.core.settings import model_name


def output_line(
    *,
    custom_id: str,
    model: str,
    text: str | None = None,
    finish_reason: str | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    error_code: str | None = None,
    error_message: str | None = None,
    request_id: str | None = None,
    created: float | None = None,
    extra_usage: dict[str, Any] | None = None,
    reasoning: str | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """One OpenAI batch output line. Errors: `response` null, `error` {code, message}. A row that
    thought before its document (`DecodeRequest.think`) has the thought as `message.reasoning_content`
    (as vLLM and DeepSeek return it) and its tokens as `usage.completion_tokens_details.reasoning_tokens`
    (OpenAI's field; they are part of `completion_tokens`)."""
    rid = request_id or uuid.uuid4().hex
    line: dict[str, Any] = {"id": f"batch_req_{rid}", "custom_id": custom_id}
    if error_code is not None:
        line["response"] = None
        line["error"] = {"code": error_code, "message": error_message or error_code}
        return line
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **(extra_usage or {}),
    }
    message: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    line["response"] = {
        "status_code": 200,
        "request_id": rid,
        "body": {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": int(created if created is not None else time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage,
        },
    }
    line["error"] = None
    return line


def cut_at_stop(text: str, stop: list[str] | None, finish_reason: str | None) -> tuple[str, str | None]:
    """OpenAI `stop`: the text ends before the earliest stop sequence, which is not included, and the
    finish reason is then "stop". The decoders generate whole canvases, so the cut is made here."""
    cuts = [i for i in (text.find(x) for x in stop or () if x) if i >= 0]
    return (text[: min(cuts)], "stop") if cuts else (text, finish_reason)


def write_results(
    store, run, out, errors_out=None, ordered: bool = False, error_codes: dict[str, str] | None = None
) -> tuple[int, int]:
    """Write OpenAI batch output lines; errored/expired/cancelled rows go to `errors_out` when given.
    `error_codes` renames stored error codes (the Batch API writes `expired` as `batch_expired`)."""
    n_ok = n_err = 0
    name = model_name(run.model)
    for row in store.iter_results(run.id, ordered=ordered):
        o = row["output"]
        rid = uuid.uuid5(uuid.NAMESPACE_URL, f"canvasq:{run.id}:{row['custom_id']}").hex
        if row["status"] == "done" and o is not None and o.error_code is None:
            text, finish = cut_at_stop(o.text or "", row.get("stop"), o.finish_reason)
            line = output_line(
                custom_id=row["custom_id"],
                model=name,
                text=text,
                finish_reason=finish,
                prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                request_id=rid,
                created=o.updated_at.timestamp(),
                extra_usage={"forwards": o.forwards, "decoder": o.decoder},
                reasoning=o.reasoning,
                reasoning_tokens=o.reasoning_tokens,
            )
            target, n_ok = out, n_ok + 1
        else:
            code = o.error_code if o is not None and o.error_code else row["status"]
            code = (error_codes or {}).get(code, code)
            msg = o.error_message if o is not None and o.error_message else f"request {row['status']}"
            line = output_line(
                custom_id=row["custom_id"], model=name, error_code=code, error_message=msg, request_id=rid
            )
            target, n_err = (errors_out or out), n_err + 1
        target.write(json.dumps(line, ensure_ascii=False) + "\n")
    return n_ok, n_err
