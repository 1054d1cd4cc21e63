"""SQLAlchemy 2 tables of the store. Counts are never stored: they are GROUP BY over these rows.

runs ─< requests (UNIQUE run_id, custom_id) ─< outputs (same key, upserted) ─< forward_traces
runs ─< chunks (attempts, lease) ─< requests.chunk_id ;  workers (host, device, model, heartbeat)
calibrations (model path + weights fingerprint) ─< calibration_points (one decoder setting per family)
api_keys (project, SHA-256 of the token) ; api_files, api_batches (owned by a project) ── runs (`canvasq serve`)

Statuses
  run:     queued → running → completed | cancelling → cancelled | expired | interrupted (embedded)
  request: queued → done | errored | expired | cancelled          (terminal: all but queued)
  chunk:   queued → running → done | failed
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints so Alembic batch mode (SQLite) can drop and recreate them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)  # naive UTC in both dialects


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    model: Mapped[str] = mapped_column(String(500))
    queue: Mapped[str] = mapped_column(String(200))
    decoder: Mapped[str] = mapped_column(String(32), default="auto")
    chunk_size: Mapped[int | None] = mapped_column(Integer)  # rows per chunk at creation (retry reuses it)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    mode: Mapped[str] = mapped_column(String(16), default="queue")  # queue | embedded
    input_path: Mapped[str | None] = mapped_column(Text)
    input_sha256: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime)


class Chunk(Base):
    __tablename__ = "chunks"
    id: Mapped[str] = mapped_column(String(48), primary_key=True)  # "<run>-<seq>"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    published_at: Mapped[datetime | None] = mapped_column(DateTime)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    last_error: Mapped[str | None] = mapped_column(Text)  # the last exception that ended a delivery
    # claimed from SQL ahead of its message by a worker with free decode slots (`QueueStore.claim_ahead`)
    claimed_ahead: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    __table_args__ = (UniqueConstraint("run_id", "seq"),)


class Request(Base):
    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    custom_id: Mapped[str] = mapped_column(String(200))
    line_no: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    task: Mapped[str | None] = mapped_column(String(16))
    max_tokens: Mapped[int] = mapped_column(Integer)
    decoder: Mapped[str | None] = mapped_column(String(32))
    stop: Mapped[list | None] = mapped_column(JSON)  # stop sequences, applied to the text on export
    response_format: Mapped[dict | None] = mapped_column(
        JSON
    )  # the JSON schema of the output (migration 0008)
    # free text before the document (`reasoning_effort` low / medium / high; migration 0009)
    think: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    chunk_id: Mapped[str | None] = mapped_column(ForeignKey("chunks.id", ondelete="SET NULL"), index=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    __table_args__ = (
        UniqueConstraint("run_id", "custom_id"),
        Index("ix_requests_run_id_status", "run_id", "status"),
    )


class Output(Base):
    """One per (run, custom_id), written by upsert; errors live here too (error_code set)."""

    __tablename__ = "outputs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32))
    custom_id: Mapped[str] = mapped_column(String(200))
    text: Mapped[str | None] = mapped_column(Text)
    token_ids: Mapped[list | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    forwards: Mapped[int] = mapped_column(Integer, default=0)
    decoder: Mapped[str | None] = mapped_column(String(32))
    gen_ms: Mapped[float] = mapped_column(Float, default=0.0)  # this row's share of its batch's wall time
    worker_id: Mapped[str | None] = mapped_column(String(200), index=True)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    # a constrained row's thought before its document (`DecodeRequest.think`) and its completion tokens
    reasoning: Mapped[str | None] = mapped_column(Text)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    __table_args__ = (
        UniqueConstraint("run_id", "custom_id"),
        ForeignKeyConstraint(
            ["run_id", "custom_id"], ["requests.run_id", "requests.custom_id"], ondelete="CASCADE"
        ),
    )


class ForwardTraceRow(Base):
    """One model pass that served one request: rows in the window (G, whole batch), commits (τ),
    canvases live and their states, ms; own_rows / own_commits are this request's part."""

    __tablename__ = "forward_traces"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32))
    custom_id: Mapped[str] = mapped_column(String(200))
    forward_index: Mapped[int] = mapped_column(Integer)
    rows: Mapped[int] = mapped_column(Integer)
    commits: Mapped[int] = mapped_column(Integer)
    canvases: Mapped[int] = mapped_column(Integer)
    states: Mapped[str] = mapped_column(String(200), default="")
    ms: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16), default="decode")  # decode | encode
    own_rows: Mapped[int | None] = mapped_column(Integer)  # this request's rows of the G above
    own_commits: Mapped[int | None] = mapped_column(Integer)  # this request's share of τ
    __table_args__ = (
        UniqueConstraint("run_id", "custom_id", "forward_index"),
        ForeignKeyConstraint(
            ["run_id", "custom_id"], ["requests.run_id", "requests.custom_id"], ondelete="CASCADE"
        ),
    )


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # "<host>:<pid>"
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(String(64))  # CUDA_VISIBLE_DEVICES or "cpu"
    model: Mapped[str] = mapped_column(String(500))
    queue: Mapped[str | None] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class CalibrationRun(Base):
    """One `canvasq calibrate` sweep of one model, identified by its path and a fingerprint of its
    weights (config.json hash + weight file names and sizes); the newest one for a model routes."""

    __tablename__ = "calibrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_path: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    device: Mapped[str] = mapped_column(String(64))
    hardware: Mapped[str | None] = mapped_column(String(200))
    commit: Mapped[str | None] = mapped_column(String(64))
    batch_size: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)  # problems per task per seed
    seeds: Mapped[list] = mapped_column(JSON)
    max_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class CalibrationPoint(Base):
    """One decoder setting measured on one task family's dev set: accuracy, tok/s at the sweep's
    batch, forwards per request, τ (tokens per forward) and G/τ (rows per token)."""

    __tablename__ = "calibration_points"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    calibration_id: Mapped[int] = mapped_column(ForeignKey("calibrations.id", ondelete="CASCADE"), index=True)
    family: Mapped[str] = mapped_column(String(32))  # routing key: "math" | "code" | a task name
    task: Mapped[str] = mapped_column(String(32))  # the dev set it was measured on
    decoder: Mapped[str] = mapped_column(String(32))
    knobs: Mapped[dict] = mapped_column(JSON)
    label: Mapped[str] = mapped_column(String(200))
    n: Mapped[int] = mapped_column(Integer)
    accuracy: Mapped[float] = mapped_column(Float)
    tok_s: Mapped[float] = mapped_column(Float)
    fwd_per_req: Mapped[float] = mapped_column(Float)
    tau: Mapped[float] = mapped_column(Float)
    g_over_tau: Mapped[float] = mapped_column(Float)
    frontier: Mapped[bool] = mapped_column(Boolean, default=False)
    reference: Mapped[bool] = mapped_column(Boolean, default=False)  # official at the checkpoint config


class ApiKey(Base):
    """A bearer key of `canvasq serve`: only its SHA-256 is stored (keys are 256-bit random tokens, so
    a fast hash is enough; the token itself is shown once, by `canvasq keys create`)."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # "key_<hex>", safe to print
    project: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16))  # the token's first characters, to recognise it
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime)


class ApiFile(Base):
    """A file of the Files API: an uploaded batch input, or a batch's output / error file. The bytes
    live in the server's files directory under `path`; `seq` orders listings and cursors."""

    __tablename__ = "api_files"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)  # "file-<hex>"
    project: Mapped[str] = mapped_column(String(200), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    bytes: Mapped[int] = mapped_column(Integer)
    lines: Mapped[int] = mapped_column(Integer, default=0)
    sha256: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(255))  # relative to the files directory
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # past it the file is gone: no route finds it, and the server's finalizer deletes row and bytes
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, index=True)


class ApiBatch(Base):
    """A batch of the Batches API: one run (None when the input failed validation). Status and counts
    are read from the run and its rows; this row holds what the run does not: the project, the
    OpenAI fields, the per-status times the run has no column for, and the output files once made."""

    __tablename__ = "api_batches"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)  # "batch_<hex>"
    project: Mapped[str] = mapped_column(String(200), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict | None] = mapped_column(JSON)  # the batch's `metadata`
    # `output_expires_after.seconds`: the output and error files expire that long after they are made
    output_expires_s: Mapped[int | None] = mapped_column(Integer)
    errors: Mapped[list | None] = mapped_column(JSON)  # validation errors: [{code, line, message, param}]
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    failed_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(
        DateTime
    )  # output files made: completed/cancelled/expired
