"""Fixtures on the real services: a SQLite file per test, a fresh PostgreSQL database per session,
a unique Redis queue per test. Settings are re-read from the environment for each test. The test
rooms that use them (core, cli, serve, deploy) import them in their conftest.py."""

from __future__ import annotations

import pytest

from canvasq.core.settings import reload_settings
from canvasq.core.store import Store
from tests.harness.backends import REDIS_URL, drop_queue, fresh_pg_database, unique_queue


@pytest.fixture(scope="session")
def pg_url():
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'canvasq.sqlite'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """A migrated store on each dialect (PostgreSQL: a fresh database for this test)."""
    if request.param == "sqlite":
        st = Store(f"sqlite:///{tmp_path / 'canvasq.sqlite'}")
        st.upgrade()
        yield st
        st.dispose()
    else:
        with fresh_pg_database() as url:
            st = Store(url)
            st.upgrade()
            yield st
            st.dispose()


@pytest.fixture
def service_env(tmp_path, monkeypatch):
    """Environment for CLI tests: SQLite file in tmp, the real Redis, a queue of our own."""
    queue = unique_queue()
    db = tmp_path / "canvasq.sqlite"
    monkeypatch.setenv("CANVASQ_DATABASE_URL", f"sqlite:///{db}")
    monkeypatch.setenv("CANVASQ_BROKER_URL", REDIS_URL)
    monkeypatch.chdir(tmp_path)
    reload_settings()
    yield {"queue": queue, "db": db, "url": f"sqlite:///{db}", "tmp": tmp_path}
    drop_queue(queue)
    monkeypatch.undo()
    reload_settings()
