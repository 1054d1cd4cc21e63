"""The batch objects that cross from the worker into a decoder, and what comes back.

Flow: Job (core, CPU: a validated input line) → DecodeBatch (worker: several prompts of one chunk,
tokenised) → windows (model, GPU: `Window`s, the rows of one forward). This module holds the
middle layer and the results; it imports nothing heavy so the service can use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a row ended (a StrEnum: equal to, and stored as, its string)."""

    stop = "stop"  # EOS, or a stop sequence cut on export
    length = "length"  # max_tokens reached
    error = "error"  # the row failed; `DecodeResult.error` says why
    cancelled = "cancelled"  # stopped by `should_stop` (its run cancelled or expired)


@dataclass
class DecodeRequest:
    """One prompt of a chunk, tokenised by the worker."""

    custom_id: str
    prompt_ids: list[int]
    max_tokens: int
    task: str | None = None  # "math" / "code" / None: used by routing only
    response_format: dict | None = None  # the JSON schema the answer must follow (official only)
    think: bool = False  # free text before the document (a line's `reasoning_effort`: `structured.THINK`)


@dataclass
class DecodeBatch:
    """Several prompts decoded together; a finished row leaves the batch."""

    requests: list[DecodeRequest]
    seed: int = 0


@dataclass
class ForwardTrace:
    """One model pass as the decoder saw it. `rows` is G (rows in the window, all sequences of the
    batch together), `commits` is τ (tokens committed by this pass), `kind` is "decode" for a
    denoising step and "encode" for a prefill / commit pass."""

    index: int
    rows: int
    commits: int
    canvases: int
    states: str  # e.g. "full,semi,draft" for the live canvases of the batch
    ms: float
    kind: str = "decode"
    # This request's share of the pass (a result's traces hold the batch-wide G and τ above, plus
    # these two for the row itself); None where the pass was not split per request.
    own_rows: int | None = None
    own_commits: int | None = None


@dataclass
class DecodeResult:
    custom_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # a FinishReason
    prompt_tokens: int
    forwards: int  # every model pass that served this request (decode steps and encoder passes)
    traces: list[ForwardTrace] = field(default_factory=list)
    error: str | None = None  # set when this request failed; the rest of the batch is unaffected
    decoder: str = ""  # the strategy that produced it ("official", "pipe", "funnel")
    # mechanism counters of step decoders (forced_accepts, jacobi_restarts, eos_priority, ...)
    stats: dict[str, int] = field(default_factory=dict)
    error_code: str | None = None  # the error's code where it is not a plain decode error
    reasoning: str | None = None  # a constrained row's free text before its document (`DecodeRequest.think`)
    reasoning_tokens: int = 0  # the tokens of `reasoning` (counted in the row's completion tokens)


CANCELLED = FinishReason.cancelled  # `error` and `finish_reason` of rows stopped by `should_stop`


class Interrupted(Exception):
    """One of the caller's `interrupts` (the worker's soft time limit) hit the decode. Raised from it;
    `cause` is that exception, `done` the rows that had finished without error before it."""

    def __init__(self, cause: BaseException, done: list[DecodeResult]):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.done = cause, done


def token_budget_error(
    prompt_tokens: int, max_tokens: int, canvas_length: int, context: int | None
) -> str | None:
    """Why a prompt of `prompt_tokens` ids cannot get `max_tokens` of answer within `context` positions,
    or None. The answer is generated in whole canvases, so max_tokens counts rounded up to a multiple
    of `canvas_length`. The one rule for both the validator (`core.schemas.parse_line`) and the
    decoders (`decoders.state.request_error`)."""
    if not context:
        return None
    canvases = -(-max_tokens // canvas_length)
    need = prompt_tokens + canvases * canvas_length
    if need <= context:
        return None
    return (
        f"prompt ({prompt_tokens} tokens) + max_tokens {max_tokens} rounded up to {canvases} canvases of "
        f"{canvas_length} need {need} positions; the model context is {context}"
    )
