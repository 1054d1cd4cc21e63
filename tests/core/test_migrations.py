"""Alembic upgrade → downgrade → upgrade on empty and populated databases, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from canvasq.core.db import current_revision, downgrade, head_revision, upgrade
from canvasq.core.store import Store
from tests.harness.backends import fresh_pg_database

TABLES = {
    "runs",
    "requests",
    "outputs",
    "forward_traces",
    "chunks",
    "workers",
    "calibrations",
    "calibration_points",
    "api_keys",
    "api_files",
    "api_batches",
}
API_TABLES = {"api_keys", "api_files", "api_batches"}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.sqlite'}"
    else:
        with fresh_pg_database() as u:
            yield u


def _tables(url: str) -> set[str]:
    st = Store(url)
    try:
        return set(inspect(st.engine).get_table_names()) - {"alembic_version"}
    finally:
        st.dispose()


def _populate(url: str) -> str:
    from canvasq.core.queue import ResultRecord
    from canvasq.core.schemas import Job

    st = Store(url)
    run = st.create_run(
        [Job(f"c{i}", "p", None, 8, None, i + 1) for i in range(5)], model="m", queue="q", chunk_size=2
    )
    st.claim_chunk(run.chunk_ids[0], "w", 60, 3)
    st.write_results(
        run.run_id,
        [
            ResultRecord(
                "c0",
                text="t",
                completion_tokens=3,
                traces=[
                    {"forward_index": 0, "rows": 8, "commits": 3, "canvases": 1, "states": "full", "ms": 1.0}
                ],
            )
        ],
        "w",
    )
    st.dispose()
    return run.run_id


@pytest.mark.parametrize("populated", [False, True], ids=["empty", "populated"])
def test_upgrade_downgrade_upgrade(url, populated):
    upgrade(url)
    assert _tables(url) == TABLES
    if populated:
        run_id = _populate(url)
    downgrade(url, "0003")
    assert _tables(url) == TABLES - API_TABLES
    downgrade(url, "0002")
    assert _tables(url) == TABLES - API_TABLES - {"calibrations", "calibration_points"}
    downgrade(url, "0001")  # one step down on data (batch mode on SQLite), then all the way
    if populated:
        st = Store(url)
        assert st.counts(run_id)["done"] == 1  # data survives the batch ALTER
        st.dispose()
    downgrade(url, "base")
    assert _tables(url) == set()
    upgrade(url)
    st = Store(url)
    try:
        assert current_revision(st.engine) == head_revision()
        assert _tables(url) == TABLES
        assert st.list_runs() == []
        rid = _populate(url)  # the re-created schema works
        assert st.counts(rid)["total"] == 5
    finally:
        st.dispose()


def test_models_match_migrations(url):
    """No drift between the ORM models and the migration chain (alembic's autogenerate check)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from canvasq.core.tables import Base

    upgrade(url)
    st = Store(url)
    try:
        with st.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        st.dispose()
    assert diff == []
