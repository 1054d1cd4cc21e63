"""Helpers for tests that use the real services (never mocks): a fresh PostgreSQL database per
test session, a unique Redis queue per test, and a fresh SQLite file.

    CANVASQ_TEST_PG_URL     server to create test databases on (default postgres@127.0.0.1:5432)
    CANVASQ_TEST_REDIS_URL  Redis for tests (default redis://127.0.0.1:6379/0)
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

PG_URL = os.environ.get("CANVASQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CANVASQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def model_for_tests() -> str:
    """The model tests run: $CANVASQ_TEST_MODEL, else the committed testbed once it has weights,
    else the testbed shape with random weights (same tokenizer)."""
    from canvasq.core.settings import DEFAULT_MODEL_DIR

    if os.environ.get("CANVASQ_TEST_MODEL"):
        return os.environ["CANVASQ_TEST_MODEL"]
    return str(DEFAULT_MODEL_DIR) if (DEFAULT_MODEL_DIR / "config.json").exists() else "random:testbed"


def _with_database(url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_pg_database(prefix: str = "canvasq_t") -> Iterator[str]:
    """CREATE DATABASE <prefix>_<random> on the test server; yield its URL; DROP it afterwards."""
    from sqlalchemy import create_engine, text

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(PG_URL, name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def unique_queue(prefix: str = "canvasq.test") -> str:
    return f"{prefix}.{uuid.uuid4().hex[:12]}"


def redis_client():
    import redis

    return redis.Redis.from_url(REDIS_URL)


def queue_length(queue: str) -> int:
    """Messages waiting in a Celery/kombu Redis queue (a Redis list named after the queue)."""
    r = redis_client()
    try:
        return int(r.llen(queue))
    finally:
        r.close()


def drop_queue(queue: str) -> None:
    r = redis_client()
    try:
        r.delete(queue)
    finally:
        r.close()
