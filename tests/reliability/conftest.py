"""Reliability scenarios (RELIABILITY.md T1–T21) against real services: a private redis-server
per test (destructive ones stop it), SQLite files, fresh databases on the shared PostgreSQL, or a
private PostgreSQL cluster where the scenario stops the database. Workers are real `canvasq worker`
subprocesses running the testbed model on CPU with test-sized time limits."""

from __future__ import annotations

import shutil

import pytest

from tests.harness.scenario import Scenario
from tests.harness.services import pg_bindir


@pytest.fixture
def scenario(tmp_path):
    """Factory: `with scenario(db="sqlite", visibility_timeout=20) as sc: ...`."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")

    def make(**kw) -> Scenario:
        if kw.get("db") == "private-postgresql" and pg_bindir() is None:
            pytest.skip("PostgreSQL server binaries not installed")
        return Scenario(tmp_path, **kw)

    return make
