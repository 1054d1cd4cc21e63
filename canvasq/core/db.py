"""The store's engine and schema: SQLite / PostgreSQL set-up, Alembic migrations, and the helpers
every store query shares. `StoreBase` holds the engine; the queue protocol (`core.queue.QueueStore`)
and the reports (`core.reports.Reports`) are its two faces, and `core.store.Store` is both.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import tenacity
from sqlalchemy import CursorResult, Engine, Result, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from canvasq.core.settings import REPO_ROOT

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PgInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert

MIGRATIONS_DIR = REPO_ROOT / "migrations"
F = TypeVar("F", bound=Callable[..., Any])


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
        return (
            f"CANVASQ_DATABASE_URL={url!r} is not a database URL (sqlite:///PATH or postgresql+psycopg://...)"
        )
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        return (
            f"CANVASQ_DATABASE_URL: {u.get_backend_name()!r} databases are not supported; "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
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
    table = getattr(model, "__table__", model)
    stmt: PgInsert | SqliteInsert  # rows as executemany parameters: the statement compiles once (cached)
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(table)
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        stmt = sqlite_insert(table)
    else:  # pragma: no cover - only the two tested dialects are supported
        raise NotImplementedError(dialect)
    if update_cols:
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_={c: getattr(stmt.excluded, c) for c in update_cols}
        )
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
    session.execute(stmt, list(rows))


def rowcount(result: Result[*tuple[Any, ...]]) -> int:
    """The rows an UPDATE or DELETE matched: `Session.execute` types its answer as a plain Result,
    though a DML statement's is a CursorResult."""
    return cast(CursorResult[Any], result).rowcount


def _transient(exc: BaseException) -> bool:
    """A connection-level failure worth another try (the database refused or dropped the connection);
    a deterministic error (constraint, syntax, data) is not."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def transient(fn: F) -> F:
    """The store protocol's one retry rule, as a decorator on each call a worker makes: up to 6 tries
    with exponential backoff (0.5, 1, 2, 4, 8 s) on connection-level errors (a database that refuses
    connections briefly), deterministic errors raised at once. Every decorated call is one transaction
    that is safe to run again (a claim, a write keyed by custom_id, a state change)."""
    return cast(
        F,
        tenacity.retry(
            retry=tenacity.retry_if_exception(_transient),
            stop=tenacity.stop_after_attempt(6),
            wait=tenacity.wait_exponential(multiplier=0.5),
            reraise=True,
        )(fn),
    )


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def new_run_id() -> str:
    return "run_" + uuid.uuid4().hex[:16]


# ---------------------------------------------------------------------------------------- base


class StoreBase:
    """One engine and its sessions; what both faces of the store stand on."""

    def __init__(self, url: str, busy_timeout_ms: int = 30_000):
        self.url = url
        self.engine = make_engine(url, busy_timeout_ms)
        self.Session = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings) -> Self:
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
