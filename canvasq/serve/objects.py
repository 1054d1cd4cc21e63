"""The objects the Batch API answers with, typed as OpenAI's own client reads them (`openai.types.Batch`,
`FileObject`, `FileDeleted`, the cursor pages): each route declares its `response_model`, so
/openapi.json describes what a stock client receives. canvasq's one extension, `Batch.canvasq`, is a
field such clients keep as an extra."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, Field

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FilePurpose = Literal["batch", "batch_output"]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int  # errored, expired and cancelled rows


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class BatchError(BaseModel):
    code: str | None = None
    line: int | None = None  # 1-based; None for the file as a whole
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class DecoderProgress(BaseModel):
    decoder: str
    requests: int
    tokens: int
    forwards: int
    gen_s: float
    tok_s: float | None


class RunProgress(BaseModel):
    """A run's progress in tokens (in the spirit of Fireworks' jobProgress)."""

    completion_tokens: int
    prompt_tokens: int
    forwards: int
    wall_s: float
    tok_s: float | None
    eta_s: float | None
    decoders: list[DecoderProgress]


class CanvasqBatch(BaseModel):
    """canvasq's extension of a batch: the run behind it and its progress."""

    run_id: str
    run_status: str
    decoder: str
    counts: dict[str, int]  # rows per request status, and total
    progress: RunProgress


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage | None
    canvasq: CanvasqBatch | None = None  # None until the batch has a run (validating, failed)


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None  # files live until deleted


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


T = TypeVar("T", Batch, FileObject)


class Page(BaseModel, Generic[T]):
    """A cursor page (`after` = `last_id`), as the client's `SyncCursorPage` reads it."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[T], has_more: bool) -> Page[T]:
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )
