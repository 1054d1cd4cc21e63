"""The SQL store: engine set-up, idempotent writes, and every query the CLI and workers ask.

Exactly-once outputs over at-least-once delivery: a result is written only while its request row is
still `queued` (a conditional UPDATE decides, inside the same transaction as the output upsert), so
a redelivered or duplicated chunk writes nothing new. Counts, tokens and throughput are GROUP BY over
rows. Run and request rows are committed before any chunk is published (outbox; `reconcile` publishes
what a crash left unpublished).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, and_, case, create_engine, delete, event, func, insert, or_, select, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from canvasq.core.schemas import Job
from canvasq.core.settings import REPO_ROOT
from canvasq.core.tables import (
    REQUEST_STATUSES,
    REQUEST_TERMINAL,
    RUN_ACTIVE,
    Chunk,
    ForwardTraceRow,
    Output,
    Request,
    Run,
    Worker,
    utcnow,
)

MIGRATIONS_DIR = REPO_ROOT / "migrations"


# ---------------------------------------------------------------------------------------- engine


def make_engine(url: str, busy_timeout_ms: int = 30_000) -> Engine:
    """An engine; for SQLite every connection gets WAL, busy_timeout and foreign_keys=ON, and every
    transaction starts with BEGIN IMMEDIATE so concurrent writer processes queue on the lock instead
    of failing a read→write upgrade with "database is locked"."""
    if url.startswith("sqlite"):
        _create_private(url)
        engine = create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # a missing host or closed port fails in seconds, not after the OS's TCP timeout
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 10})


def _create_private(url: str) -> None:
    """Create a new SQLite store file readable by its owner only (0600): it holds every prompt and
    output. SQLite gives the -wal and -shm files the main file's mode. An existing file is left as
    it is; a file that cannot be created is reported by the first connection."""
    import os

    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception:  # noqa: BLE001 a malformed URL fails at create_engine with its own message
        return
    if u.database in (None, "", ":memory:") or u.database.startswith("file:") or u.query.get("uri"):
        return
    try:
        os.close(os.open(u.database, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        pass


def database_problem(url: str) -> str | None:
    """Why `url` cannot be the store, found before connecting (one line naming the setting), or None."""
    import os

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
    except ArgumentError:
        return f"CANVASQ_DATABASE_URL={url!r} is not a database URL (sqlite:///PATH or postgresql+psycopg://...)"
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        return (f"CANVASQ_DATABASE_URL: {u.get_backend_name()!r} databases are not supported; "
                "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB")
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
        path = Path(u.database).absolute()
        if not path.parent.is_dir():
            return f"CANVASQ_DATABASE_URL: directory {path.parent} does not exist (SQLite store {path})"
        if path.exists() and not os.access(path, os.R_OK | os.W_OK):
            return f"CANVASQ_DATABASE_URL: SQLite store {path} is not writable"
        if not os.access(path.parent, os.W_OK | os.X_OK):  # WAL needs its -wal and -shm files beside it
            return f"CANVASQ_DATABASE_URL: directory {path.parent} is not writable (SQLite store {path})"
    return None


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config(str(REPO_ROOT / "alembic.ini")) if (REPO_ROOT / "alembic.ini").exists() else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["canvasq_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


class SchemaOutOfDate(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------- helpers


def upsert(session: Session, model, rows: Sequence[dict], keys: Sequence[str], update_cols: Sequence[str]):
    """INSERT ... ON CONFLICT (keys) DO UPDATE, in the session's dialect."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    else:  # pragma: no cover - only the two tested dialects are supported
        raise NotImplementedError(dialect)
    stmt = dialect_insert(model).values(list(rows))
    if update_cols:
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_={c: getattr(stmt.excluded, c) for c in update_cols}
        )
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
    session.execute(stmt)


def retry_transient(fn: Callable[[], Any], attempts: int = 6, base_s: float = 0.5) -> Any:
    """Retry a persistence call on connection-level errors with exponential backoff (a database
    that refuses connections briefly); deterministic errors are raised at once."""
    for i in range(attempts):
        try:
            return fn()
        except (OperationalError, DBAPIError) as exc:
            if i == attempts - 1 or not (isinstance(exc, OperationalError) or exc.connection_invalidated):
                raise
            time.sleep(base_s * (2**i))
    return None  # unreachable


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def new_run_id() -> str:
    return "run_" + uuid.uuid4().hex[:16]


# ---------------------------------------------------------------------------------------- progress

IDLE_GAP_S = 120.0  # a longer pause between finished rows (and 20x their median gap) is idle time
RATE_WINDOW_S = 120.0  # the current rate: rows finished in this much of the latest active time


def active_wall(started: datetime | None, finishes: Sequence[datetime], now: datetime | None = None) -> float:
    """Seconds a run was being generated: its start to its first finished row, the gaps between finished
    rows except idle ones (longer than IDLE_GAP_S and 20x the median gap: the run had ended and was later
    retried or resumed), and, while it runs (`now`), the time since its last finished row or its start.
    tok/s over this does not fall (or restart) after a retry: the tokens and the time are both the run's."""
    ts = sorted(finishes)
    if started is None:
        return 0.0
    gaps = [(b - a).total_seconds() for a, b in pairwise(ts)]
    median = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    idle = max(IDLE_GAP_S, 20 * median)
    wall = sum(g for g in gaps if g <= idle)
    if ts and started < ts[0]:
        wall += (ts[0] - started).total_seconds()
    if now is not None:
        since = max(ts[-1], started) if ts else started
        wall += max(0.0, (now - since).total_seconds())
    return wall


def recent_rate(finishes: Sequence[datetime], now: datetime | None = None) -> float | None:
    """Rows per second at the end of the run so far: finished rows over the last RATE_WINDOW_S seconds
    (of the time since the first row finished, when that is shorter); None before two rows finish."""
    if len(finishes) < 2:
        return None
    ts = sorted(finishes)
    end = max(now or ts[-1], ts[-1])
    start = max(end - timedelta(seconds=RATE_WINDOW_S), ts[0])
    n = sum(1 for t in ts if t > start)
    span = (end - start).total_seconds()
    return n / span if span > 0 and n else None


# ---------------------------------------------------------------------------------------- records


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
    status: str = "done"  # done | errored | cancelled
    traces: list[dict] = field(default_factory=list)  # forward_index, rows, commits, canvases, states, ms, kind


@dataclass
class RunCreated:
    run_id: str
    created: bool  # False: the idempotency key matched an existing run
    chunk_ids: list[str]
    requests: int


@dataclass
class ClaimedChunk:
    """A chunk claimed for work. `state`: 'work' (rows to do), 'empty' (all done: a redelivery),
    'exhausted' (attempts past the cap: rows marked worker_lost), 'cancelled', 'missing'."""

    state: str
    chunk_id: str
    run_id: str | None = None
    model: str | None = None
    run_decoder: str | None = None
    attempts: int = 0
    requests: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- store


class Store:
    def __init__(self, url: str, busy_timeout_ms: int = 30_000):
        self.url = url
        self.engine = make_engine(url, busy_timeout_ms)
        self.Session = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings) -> Store:
        return cls(settings.database_url, settings.sqlite_busy_timeout_ms)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def dispose(self) -> None:
        self.engine.dispose()

    # -- schema ------------------------------------------------------------------------------------
    def upgrade(self) -> None:
        upgrade(self.url)

    def check_schema(self) -> None:
        cur, head = current_revision(self.engine), head_revision()
        if cur != head:
            raise SchemaOutOfDate(
                f"database schema is at {cur or 'nothing'}, code expects {head}: run `canvasq db upgrade`"
            )

    # -- submission -------------------------------------------------------------------------------
    def create_run(
        self,
        jobs: Iterable[Job],
        *,
        model: str,
        queue: str,
        decoder: str = "auto",
        chunk_size: int = 16,
        name: str | None = None,
        idempotency_key: str | None = None,
        input_path: str | None = None,
        input_sha256: str | None = None,
        mode: str = "queue",
        deadline_s: int | None = None,
        batch_rows: int = 1000,
        replace_key: bool = False,
    ) -> RunCreated:
        """Insert the run, its chunks and its requests in one transaction (streamed in batches).
        `replace_key`: a new run takes the key from the run that held it (`canvasq run --fresh`)."""
        with self.Session.begin() as s:
            if idempotency_key and replace_key:
                s.execute(update(Run).where(Run.idempotency_key == idempotency_key).values(idempotency_key=None))
            if idempotency_key:
                existing = s.scalar(select(Run).where(Run.idempotency_key == idempotency_key))
                if existing is not None:
                    chunk_ids = list(s.scalars(select(Chunk.id).where(Chunk.run_id == existing.id)))
                    n = s.scalar(select(func.count()).where(Request.run_id == existing.id))
                    return RunCreated(existing.id, False, chunk_ids, n or 0)
            run_id = new_run_id()
            now = utcnow()
            s.add(
                Run(
                    id=run_id,
                    name=name,
                    idempotency_key=idempotency_key,
                    model=model,
                    queue=queue,
                    decoder=decoder,
                    chunk_size=chunk_size,
                    status="queued",
                    mode=mode,
                    input_path=input_path,
                    input_sha256=input_sha256,
                    created_at=now,
                    updated_at=now,
                    deadline_at=now + timedelta(seconds=deadline_s) if deadline_s else None,
                )
            )
            s.flush()
            chunk_ids: list[str] = []
            chunks: list[dict] = []  # chunk rows not yet inserted
            buf: list[dict] = []

            def flush() -> None:  # one executemany per table; chunks first, the requests point at them
                for table, rows in ((Chunk, chunks), (Request, buf)):
                    if rows:
                        s.execute(insert(table), rows)
                        rows.clear()

            n = 0
            for job in jobs:
                seq = n // chunk_size
                if seq == len(chunk_ids):
                    chunk_ids.append(f"{run_id}-{seq:05d}")
                    chunks.append(dict(id=chunk_ids[seq], run_id=run_id, seq=seq, status="queued", attempts=0,
                                       updated_at=now))
                buf.append(
                    dict(run_id=run_id, custom_id=job.custom_id, line_no=job.line_no, prompt=job.prompt,
                         task=job.task, max_tokens=job.max_tokens, decoder=job.decoder,
                         stop=list(job.stop) or None, chunk_id=chunk_ids[seq], status="queued", updated_at=now)
                )
                n += 1
                if len(buf) >= batch_rows:
                    flush()
            flush()
            if n == 0:
                raise ValueError("a run needs at least one request")
        return RunCreated(run_id, True, chunk_ids, n)

    def mark_published(self, chunk_ids: Sequence[str]) -> None:
        if not chunk_ids:
            return
        with self.Session.begin() as s:
            s.execute(update(Chunk).where(Chunk.id.in_(list(chunk_ids))).values(published_at=utcnow()))

    def unpublished_chunks(self, run_id: str | None = None) -> list[tuple[str, str]]:
        """(chunk_id, queue) of queued chunks never published (outbox leftovers), of one run or all."""
        with self.Session() as s:
            q = (
                select(Chunk.id, Run.queue)
                .join(Run, Run.id == Chunk.run_id)
                .where(Chunk.status == "queued", Chunk.published_at.is_(None))
            )
            if run_id is not None:
                q = q.where(Chunk.run_id == run_id)
            return [(r[0], r[1]) for r in s.execute(q.order_by(Chunk.id))]

    # -- worker side ------------------------------------------------------------------------------
    def claim_chunk(self, chunk_id: str, worker_id: str, lease_s: int, max_attempts: int) -> ClaimedChunk:
        """Count this delivery (attempts in SQL: Celery does not cap redelivery, celery#9082) and
        return the chunk's unfinished rows. Past `max_attempts` the rows become errored/worker_lost."""
        now = utcnow()
        with self.Session.begin() as s:
            row = s.execute(
                select(Chunk, Run).join(Run, Run.id == Chunk.run_id).where(Chunk.id == chunk_id)
            ).first()
            if row is None:
                return ClaimedChunk("missing", chunk_id)
            chunk, run = row
            attempts = chunk.attempts + 1
            s.execute(
                update(Chunk)
                .where(Chunk.id == chunk_id)
                .values(attempts=Chunk.attempts + 1, status="running", worker_id=worker_id,
                        lease_expires_at=now + timedelta(seconds=lease_s), updated_at=now)
            )
            claimed = ClaimedChunk("work", chunk_id, run.id, run.model, run.decoder, attempts)
            if run.status in ("cancelling", "cancelled", "expired"):
                status = "expired" if run.status == "expired" else "cancelled"
                self._close_rows(s, chunk_id, run.id, status, status, f"run {run.status}")
                claimed.state = "cancelled"
                return claimed
            if attempts > max_attempts:
                self._close_rows(
                    s, chunk_id, run.id, "errored", "worker_lost",
                    f"chunk delivered {attempts} times without finishing (max_attempts={max_attempts})",
                )
                s.execute(update(Chunk).where(Chunk.id == chunk_id).values(status="failed", updated_at=now))
                claimed.state = "exhausted"
                return claimed
            if run.status == "queued":
                s.execute(update(Run).where(Run.id == run.id, Run.status == "queued")
                          .values(status="running", started_at=now, updated_at=now))
            reqs = s.execute(
                select(Request.custom_id, Request.prompt, Request.task, Request.max_tokens, Request.decoder)
                .where(Request.chunk_id == chunk_id, Request.status == "queued")
                .order_by(Request.line_no)
            ).all()
            claimed.requests = [r._asdict() for r in reqs]
            if not reqs:
                claimed.state = "empty"
            return claimed

    def close_chunk_rows(self, chunk_id: str, run_id: str, status: str, code: str, message: str) -> int:
        with self.Session.begin() as s:
            return self._close_rows(s, chunk_id, run_id, status, code, message)

    def record_chunk_error(self, chunk_id: str, message: str) -> None:
        with self.Session.begin() as s:
            s.execute(update(Chunk).where(Chunk.id == chunk_id).values(last_error=message[:4000], updated_at=utcnow()))

    def _close_rows(self, s: Session, chunk_id: str, run_id: str, status: str, code: str, message: str) -> int:
        """Unfinished rows of a chunk → terminal `status`, with an error output line each."""
        ids = list(s.scalars(select(Request.custom_id).where(Request.chunk_id == chunk_id,
                                                              Request.status == "queued")))
        if not ids:
            return 0
        now = utcnow()
        s.execute(update(Request).where(Request.run_id == run_id, Request.custom_id.in_(ids),
                                        Request.status == "queued").values(status=status, updated_at=now))
        upsert(
            s, Output,
            [dict(run_id=run_id, custom_id=c, error_code=code, error_message=message, text=None,
                  created_at=now, updated_at=now) for c in ids],
            ("run_id", "custom_id"), ("error_code", "error_message", "text", "updated_at"),
        )
        return len(ids)

    def write_results(self, run_id: str, records: Sequence[ResultRecord], worker_id: str | None = None) -> int:
        """Store results of requests still `queued`; returns how many were written (0 on a
        duplicate delivery). One transaction: request status, output upsert, traces."""
        written = 0
        now = utcnow()
        with self.Session.begin() as s:
            for r in records:
                res = s.execute(
                    update(Request)
                    .where(Request.run_id == run_id, Request.custom_id == r.custom_id, Request.status == "queued")
                    .values(status=r.status, updated_at=now)
                )
                if res.rowcount != 1:
                    continue  # already terminal: a redelivery or a late duplicate
                written += 1
                vals = dict(
                    run_id=run_id, custom_id=r.custom_id, text=r.text, token_ids=r.token_ids,
                    finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                    completion_tokens=r.completion_tokens, forwards=r.forwards, decoder=r.decoder,
                    gen_ms=r.gen_ms, worker_id=worker_id, error_code=r.error_code,
                    error_message=r.error_message, created_at=now, updated_at=now,
                )
                upsert(s, Output, [vals], ("run_id", "custom_id"),
                       [k for k in vals if k not in ("run_id", "custom_id", "created_at")])
                s.execute(delete(ForwardTraceRow).where(ForwardTraceRow.run_id == run_id,
                                                        ForwardTraceRow.custom_id == r.custom_id))
                if r.traces:
                    s.execute(insert(ForwardTraceRow),
                              [dict(run_id=run_id, custom_id=r.custom_id, **t) for t in r.traces])
        return written

    def finish_chunk(self, chunk_id: str) -> None:
        with self.Session.begin() as s:
            s.execute(update(Chunk).where(Chunk.id == chunk_id).values(status="done", updated_at=utcnow()))

    def run_status(self, run_id: str) -> str | None:
        with self.Session() as s:
            return s.scalar(select(Run.status).where(Run.id == run_id))

    def finalize_run(self, run_id: str) -> str | None:
        """If no row is left queued: cancelling → cancelled, queued/running → completed."""
        now = utcnow()
        with self.Session.begin() as s:
            left = s.scalar(select(func.count()).where(Request.run_id == run_id, Request.status == "queued"))
            if left:
                return None
            s.execute(update(Run).where(Run.id == run_id, Run.status == "cancelling")
                      .values(status="cancelled", finished_at=now, updated_at=now))
            s.execute(update(Run).where(Run.id == run_id, Run.status.in_(("queued", "running", "interrupted")))
                      .values(status="completed", finished_at=now, updated_at=now))
            return s.scalar(select(Run.status).where(Run.id == run_id))

    def register_worker(self, worker_id: str, host: str, pid: int, device: str, model: str,
                        queue: str | None) -> None:
        now = utcnow()
        with self.Session.begin() as s:
            upsert(s, Worker, [dict(id=worker_id, host=host, pid=pid, device=device, model=model, queue=queue,
                                    started_at=now, heartbeat_at=now)],
                   ("id",), ("host", "pid", "device", "model", "queue", "heartbeat_at"))

    def heartbeat(self, worker_id: str, chunk_id: str | None = None, lease_s: float | None = None) -> bool:
        """The worker is alive; while it works on `chunk_id` that chunk's lease moves to now + lease_s.
        Only a chunk still `running` under this worker is renewed (one re-published and claimed by
        another worker is that worker's). Returns whether a lease was renewed."""
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=now))
            if chunk_id is None or lease_s is None:
                return False
            res = s.execute(update(Chunk)
                            .where(Chunk.id == chunk_id, Chunk.worker_id == worker_id, Chunk.status == "running")
                            .values(lease_expires_at=now + timedelta(seconds=lease_s)))
            return res.rowcount == 1

    # -- embedded runs ----------------------------------------------------------------------------
    def run_by_key(self, idempotency_key: str) -> str | None:
        with self.Session() as s:
            return s.scalar(select(Run.id).where(Run.idempotency_key == idempotency_key))

    def pending_chunks(self, run_id: str) -> list[str]:
        """Chunks that still hold `queued` rows, in order: what a resumed embedded run has left to do
        (a chunk cut short by an interrupt is among them, whatever its own status says)."""
        with self.Session() as s:
            return list(s.scalars(
                select(Chunk.id).where(Chunk.run_id == run_id,
                                       Chunk.id.in_(select(Request.chunk_id).where(Request.run_id == run_id,
                                                                                   Request.status == "queued")))
                .order_by(Chunk.seq)))

    def embedded_owner(self, run_id: str) -> Worker | None:
        """The process that last generated an embedded run (registered with queue `embedded:<run>`)."""
        with self.Session() as s:
            return s.scalar(select(Worker).where(Worker.queue == f"embedded:{run_id}")
                            .order_by(Worker.started_at.desc()).limit(1))

    def active_embedded_runs(self) -> list[str]:
        with self.Session() as s:
            return list(s.scalars(select(Run.id).where(Run.mode == "embedded", Run.status.in_(RUN_ACTIVE))))

    def mark_interrupted(self, run_id: str, release_chunks: bool = False) -> None:
        """An embedded run whose process stopped before the end: `interrupted` (rerunning the same
        `canvasq run` resumes it). A cancel in progress stays `cancelling`. `release_chunks` (a clean
        stop, Ctrl-C): its running chunks go back to queued and that delivery is not counted against
        `max_attempts`, which is there for chunks that kill their process."""
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(update(Run).where(Run.id == run_id, Run.status.in_(("queued", "running")))
                      .values(status="interrupted", updated_at=now))
            if release_chunks:
                s.execute(update(Chunk).where(Chunk.run_id == run_id, Chunk.status == "running")
                          .values(status="queued", attempts=func.max(Chunk.attempts - 1, 0)
                                  if self.dialect == "sqlite" else func.greatest(Chunk.attempts - 1, 0),
                                  lease_expires_at=None, updated_at=now))

    def resume_run(self, run_id: str) -> None:
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(update(Run).where(Run.id == run_id, Run.status.in_(("queued", "running", "interrupted")))
                      .values(status="running", finished_at=None, updated_at=now,
                              started_at=func.coalesce(Run.started_at, now)))

    # -- control ----------------------------------------------------------------------------------
    def cancel_run(self, run_id: str, close_running: bool = False) -> str | None:
        """Flag the run `cancelling`; rows of chunks no worker holds are cancelled now. Running
        chunks see the flag between decoder steps. `close_running`: no process holds any chunk (an
        interrupted embedded run), so the rows of `running` chunks are cancelled now too."""
        now = utcnow()
        with self.Session.begin() as s:
            s.execute(update(Run).where(Run.id == run_id, Run.status.in_((*RUN_ACTIVE, "interrupted")))
                      .values(status="cancelling", updated_at=now))
            q = select(Chunk.id).where(Chunk.run_id == run_id)
            if not close_running:
                q = q.where(Chunk.status == "queued")
            for cid in s.scalars(q):
                self._close_rows(s, cid, run_id, "cancelled", "cancelled", "run cancelled")
        self.finalize_run(run_id)
        return self.run_status(run_id)

    def stuck_rows(self, run_id: str, offline_before: datetime, s: Session | None = None) -> list[str]:
        """Queued rows of a run that no live worker will finish: their chunk is `running` under a lease
        that expired or a worker whose last heartbeat is before `offline_before`, or it ended
        (done / failed) with the rows left queued, or it was never published. Rows of chunks that a
        live worker holds or that wait in the broker's queue are not stuck."""
        held_by_dead = and_(Chunk.status == "running",
                            or_(Chunk.lease_expires_at.is_(None), Chunk.lease_expires_at < utcnow(),
                                Worker.id.is_(None), Worker.heartbeat_at < offline_before))
        q = (select(Request.custom_id)
             .outerjoin(Chunk, Chunk.id == Request.chunk_id)
             .outerjoin(Worker, Worker.id == Chunk.worker_id)
             .where(Request.run_id == run_id, Request.status == "queued",
                    or_(Chunk.id.is_(None), held_by_dead, Chunk.status.in_(("done", "failed")),
                        and_(Chunk.status == "queued", Chunk.published_at.is_(None))))
             .order_by(Request.line_no))
        if s is not None:
            return list(s.scalars(q))
        with self.Session() as s2:
            return list(s2.scalars(q))

    def retry_run(self, run_id: str, only: Sequence[str], chunk_size: int,
                  offline_before: datetime | None = None) -> list[str]:
        """Re-queue rows whose status is in `only` into new chunks; returns the new chunk ids.
        `stuck` in `only` (with `offline_before`) adds the queued rows `stuck_rows` finds."""
        now = utcnow()
        with self.Session.begin() as s:
            ids = list(s.scalars(select(Request.custom_id)
                                 .where(Request.run_id == run_id, Request.status.in_(list(only)))
                                 .order_by(Request.line_no)))
            if "stuck" in only and offline_before is not None:
                ids += self.stuck_rows(run_id, offline_before, s)
            if not ids:
                return []
            old_chunks = set(s.scalars(select(Request.chunk_id).where(Request.run_id == run_id,
                                                                      Request.custom_id.in_(ids))))
            base = (s.scalar(select(func.max(Chunk.seq)).where(Chunk.run_id == run_id)) or 0) + 1
            chunk_ids = []
            for i in range(0, len(ids), chunk_size):
                seq = base + i // chunk_size
                cid = f"{run_id}-{seq:05d}"
                s.execute(insert(Chunk).values(id=cid, run_id=run_id, seq=seq, status="queued",
                                               attempts=0, updated_at=now))
                s.execute(update(Request)
                          .where(Request.run_id == run_id, Request.custom_id.in_(ids[i:i + chunk_size]))
                          .values(status="queued", chunk_id=cid, updated_at=now))
                chunk_ids.append(cid)
            # a stuck chunk whose rows all moved is over: neither reconcile nor its dead owner's
            # late renewal has anything left in it
            s.execute(update(Chunk)
                      .where(Chunk.id.in_([c for c in old_chunks if c]), Chunk.status.in_(("queued", "running")),
                             ~select(Request.id).where(Request.chunk_id == Chunk.id, Request.status == "queued")
                             .exists())
                      .values(status="done", lease_expires_at=None, published_at=func.coalesce(Chunk.published_at, now),
                              updated_at=now))
            run = s.get(Run, run_id)
            # A retry gets a fresh deadline of the original length; the old, passed one would make the
            # next reconcile pass expire the retried rows again at once.
            deadline = now + (run.deadline_at - run.created_at) if run and run.deadline_at else None
            s.execute(update(Run).where(Run.id == run_id)  # a run still being worked on stays `running`
                      .values(status=case((Run.status == "running", "running"), else_="queued"), finished_at=None,
                              updated_at=now, deadline_at=deadline))
            return chunk_ids

    def expire_overdue(self, now: datetime | None = None) -> list[str]:
        """Runs past their deadline: unfinished rows `expired` (finished rows stay), run `expired`."""
        now = now or utcnow()
        with self.Session.begin() as s:
            runs = list(s.scalars(select(Run.id).where(Run.status.in_(RUN_ACTIVE), Run.deadline_at.is_not(None),
                                                       Run.deadline_at < now)))
            for run_id in runs:
                for cid in s.scalars(select(Chunk.id).where(Chunk.run_id == run_id)):
                    self._close_rows(s, cid, run_id, "expired", "expired", "run passed its deadline")
                s.execute(update(Run).where(Run.id == run_id)
                          .values(status="expired", finished_at=now, updated_at=now))
            return runs

    def stale_chunks(self, now: datetime | None = None) -> list[tuple[str, str]]:
        """(chunk_id, queue) of running chunks whose lease expired with rows still queued."""
        now = now or utcnow()
        with self.Session() as s:
            q = (
                select(Chunk.id, Run.queue)
                .join(Run, Run.id == Chunk.run_id)
                .where(Chunk.status == "running", Chunk.lease_expires_at < now, Run.status.in_(RUN_ACTIVE),
                       select(Request.id).where(Request.chunk_id == Chunk.id, Request.status == "queued").exists())
            )
            return [(r[0], r[1]) for r in s.execute(q.order_by(Chunk.id))]

    def active_runs(self) -> list[str]:
        with self.Session() as s:
            return list(s.scalars(select(Run.id).where(Run.status.in_(RUN_ACTIVE))))

    # -- queries ----------------------------------------------------------------------------------
    def get_run(self, run_id: str) -> Run | None:
        with self.Session() as s:
            run = s.get(Run, run_id)
            if run is None:  # accept a unique prefix too
                matches = list(s.scalars(select(Run).where(Run.id.like(f"{run_id}%")).limit(2)))
                run = matches[0] if len(matches) == 1 else None
            return run

    def counts(self, run_id: str) -> dict[str, int]:
        with self.Session() as s:
            rows = s.execute(select(Request.status, func.count()).where(Request.run_id == run_id)
                             .group_by(Request.status)).all()
        out = {k: 0 for k in REQUEST_STATUSES}
        out.update({st: n for st, n in rows})
        out["total"] = sum(n for _, n in rows)
        return out

    def largest_chunk(self, run_id: str) -> int | None:
        """The most rows any chunk of the run holds (a run's chunk size where it was not stored)."""
        with self.Session() as s:
            sizes = select(func.count().label("n")).where(Request.run_id == run_id).group_by(Request.chunk_id)
            return s.scalar(select(func.max(sizes.subquery().c.n)))

    def missing_rows(self, run_id: str, limit: int = 20) -> list[str]:
        """custom_ids of the run's rows not finished yet (queued), in input order."""
        with self.Session() as s:
            return list(s.scalars(select(Request.custom_id).where(Request.run_id == run_id, Request.status == "queued")
                                  .order_by(Request.line_no).limit(limit)))

    def row_state(self, run_id: str, custom_id: str) -> tuple[str, Output | None] | None:
        """(request status, its output) of one row, or None when the run has no such row."""
        with self.Session() as s:
            st = s.scalar(select(Request.status).where(Request.run_id == run_id, Request.custom_id == custom_id))
            if st is None:
                return None
            return st, s.scalar(select(Output).where(Output.run_id == run_id, Output.custom_id == custom_id))

    def run_summary(self, run_id: str) -> dict[str, Any]:
        """Counts, tokens, forwards and throughput for one run (all from rows)."""
        run = self.get_run(run_id)
        if run is None:
            raise KeyError(run_id)
        counts = self.counts(run.id)
        with self.Session() as s:  # one GROUP BY: the run's totals are the sums of its decoders' rows
            per_dec = s.execute(
                select(Output.decoder, func.count().label("requests"),
                       func.coalesce(func.sum(Output.completion_tokens), 0).label("tokens"),
                       func.coalesce(func.sum(Output.prompt_tokens), 0).label("prompt_tokens"),
                       func.coalesce(func.sum(Output.forwards), 0).label("forwards"),
                       func.coalesce(func.sum(Output.gen_ms), 0.0).label("gen_ms"),
                       func.max(Output.updated_at).label("last"))
                .where(Output.run_id == run.id, Output.error_code.is_(None))
                .group_by(Output.decoder).order_by(Output.decoder)
            ).all()
            finishes = list(s.scalars(select(Output.updated_at).where(Output.run_id == run.id,
                                                                      Output.error_code.is_(None))))
            in_flight = s.scalar(select(func.count()).select_from(Request)
                                 .join(Chunk, Chunk.id == Request.chunk_id)
                                 .where(Request.run_id == run.id, Request.status == "queued",
                                        Chunk.status == "running")) or 0
        tokens = sum(d.tokens for d in per_dec)
        ptoks = sum(d.prompt_tokens for d in per_dec)
        forwards = sum(d.forwards for d in per_dec)
        gen_ms = sum(d.gen_ms for d in per_dec)
        active = run.status in RUN_ACTIVE
        now = utcnow() if active and (in_flight or run.status == "running") else None  # not while it waits
        wall = active_wall(run.started_at, finishes, now)
        rate = recent_rate(finishes, now)
        eta = counts["queued"] / rate if rate and counts["queued"] and active else None
        return {
            "run_id": run.id, "name": run.name, "status": run.status, "model": run.model, "queue": run.queue,
            "decoder": run.decoder, "created_at": run.created_at.isoformat(timespec="seconds"),
            "counts": counts, "in_flight": int(in_flight), "rows_per_s": rate,
            "completion_tokens": int(tokens), "prompt_tokens": int(ptoks),
            "forwards": int(forwards), "gen_s": float(gen_ms) / 1000, "wall_s": wall,
            "tok_s": (tokens / wall) if wall > 0 else None, "eta_s": eta,
            "decoders": [
                {"decoder": d.decoder or "?", "requests": d.requests, "tokens": int(d.tokens),
                 "forwards": int(d.forwards), "gen_s": float(d.gen_ms) / 1000,
                 "tok_s": (d.tokens / (d.gen_ms / 1000)) if d.gen_ms else None}
                for d in per_dec
            ],
        }

    def list_runs(self, status: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        with self.Session() as s:
            q = select(Run).order_by(Run.created_at.desc(), Run.id).limit(limit)
            if status:
                q = q.where(Run.status == status)
            runs = list(s.scalars(q))
            if not runs:
                return []
            ids = [r.id for r in runs]
            grouped = s.execute(
                select(Request.run_id, func.count(),
                       func.sum(case((Request.status == "done", 1), else_=0)),
                       func.sum(case((Request.status == "errored", 1), else_=0)),
                       func.sum(case((Request.status == "expired", 1), else_=0)),
                       func.sum(case((Request.status == "cancelled", 1), else_=0)),
                       func.sum(case((Request.status == "queued", 1), else_=0)))
                .where(Request.run_id.in_(ids)).group_by(Request.run_id)
            ).all()
        by_run = {g[0]: g[1:] for g in grouped}
        out = []
        for r in runs:
            total, done, errored, expired, cancelled, queued = by_run.get(r.id, (0,) * 6)
            out.append({"run_id": r.id, "name": r.name, "status": r.status, "model": r.model,
                        "decoder": r.decoder, "created_at": r.created_at.isoformat(timespec="seconds"),
                        "total": int(total or 0), "done": int(done or 0), "errored": int(errored or 0),
                        "expired": int(expired or 0), "cancelled": int(cancelled or 0),
                        "queued": int(queued or 0)})
        return out

    def iter_results(self, run_id: str, ordered: bool = False, batch: int = 1000) -> Iterator[dict[str, Any]]:
        """Terminal rows with their outputs (requests without an output yield an error line)."""
        with self.Session() as s:
            q = (
                select(Request.custom_id, Request.status, Request.line_no, Request.stop, Output)
                .outerjoin(Output, and_(Output.run_id == Request.run_id, Output.custom_id == Request.custom_id))
                .where(Request.run_id == run_id, Request.status.in_(REQUEST_TERMINAL))
            )
            q = q.order_by(Request.line_no) if ordered else q.order_by(Output.updated_at, Request.line_no)
            for cid, status, line_no, stop, out in s.execute(q.execution_options(yield_per=batch)):
                yield {"custom_id": cid, "status": status, "line_no": line_no, "stop": stop, "output": out}

    def traces(self, run_id: str, custom_id: str) -> list[ForwardTraceRow]:
        with self.Session() as s:
            return list(s.scalars(select(ForwardTraceRow)
                                  .where(ForwardTraceRow.run_id == run_id, ForwardTraceRow.custom_id == custom_id)
                                  .order_by(ForwardTraceRow.forward_index)))

    def worker_stats(self, offline_after_s: float | None = None) -> list[dict[str, Any]]:
        """Throughput per worker: rows, tokens and generation time from outputs; with
        `offline_after_s`, `online` is whether its last heartbeat is more recent than that, and
        `chunk` the chunk it holds a live lease on."""
        with self.Session() as s:
            rows = s.execute(
                select(Worker.id, Worker.host, Worker.device, Worker.model, Worker.heartbeat_at,
                       func.count(Output.id), func.coalesce(func.sum(Output.completion_tokens), 0),
                       func.coalesce(func.sum(Output.gen_ms), 0.0))
                .outerjoin(Output, Output.worker_id == Worker.id)
                .group_by(Worker.id, Worker.host, Worker.device, Worker.model, Worker.heartbeat_at)
                .order_by(Worker.id)
            ).all()
        now = utcnow()
        with self.Session() as s:
            held = dict(s.execute(select(Chunk.worker_id, func.min(Chunk.id))
                                  .where(Chunk.status == "running", Chunk.lease_expires_at >= now)
                                  .group_by(Chunk.worker_id)).all())
        out = []
        for w, h, d, m, hb, n, t, ms in rows:
            age = (now - hb).total_seconds()
            rec = {"worker": w, "host": h, "device": d, "model": m, "heartbeat_at": hb.isoformat(timespec="seconds"),
                   "last_seen_s": round(age, 1), "requests": n, "tokens": int(t),
                   "tok_s": (t / (ms / 1000)) if ms else None}
            if offline_after_s is not None:
                rec["online"] = age <= offline_after_s
                rec["chunk"] = held.get(w) if rec["online"] else None
            out.append(rec)
        return out
