"""What crosses rooms through the store: `RunCreated` back to the producer, `ClaimedChunk` of
`ClaimedRequest`s out to a worker (with its `ClaimState`), `ResultRecord`s back from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from canvasq.core.statuses import RequestStatus


@dataclass
class ResultRecord:
    """What the worker hands to the store for one request (from a DecodeResult)."""

    custom_id: str
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forwards: int = 0
    decoder: str | None = None
    gen_ms: float = 0.0
    error_code: str | None = None
    error_message: str | None = None
    status: RequestStatus = RequestStatus.done  # done | errored | cancelled
    reasoning: str | None = None  # a constrained row's thought before its document (`DecodeRequest.think`)
    reasoning_tokens: int = 0  # of completion_tokens
    traces: list[dict] = field(
        default_factory=list
    )  # forward_index, rows, commits, canvases, states, ms, kind


@dataclass
class RunCreated:
    run_id: str
    created: bool  # False: the idempotency key matched an existing run
    chunk_ids: list[str]
    requests: int


class ClaimState(StrEnum):
    """What a claim found. Only `work` leaves rows for the worker to decode."""

    work = "work"  # rows to do
    empty = "empty"  # every row already terminal: a redelivery
    exhausted = "exhausted"  # delivered more than max_attempts times: its rows were closed worker_lost
    cancelled = "cancelled"  # the run is cancelling, cancelled or expired: its rows were closed so
    missing = "missing"  # no such chunk
    busy = "busy"  # claimed ahead by a live worker that is decoding it: this delivery is dropped


@dataclass(frozen=True)
class ClaimedRequest:
    """One queued row of a claimed chunk: what the worker decodes (`decoder` None: the run's)."""

    custom_id: str
    prompt: str
    task: str | None
    max_tokens: int
    decoder: str | None
    response_format: dict | None = None  # the JSON schema the output must follow (None: free text)
    think: bool = False  # free text before the document (a line's reasoning_effort)


@dataclass
class ClaimedChunk:
    """A chunk claimed for work: its state and, in state `work`, its queued rows in input order."""

    state: ClaimState
    chunk_id: str
    run_id: str | None = None
    model: str | None = None
    run_decoder: str | None = None
    attempts: int = 0
    requests: list[ClaimedRequest] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- queue
