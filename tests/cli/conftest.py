"""Tests of the CLI: commands, resume, refusals, bad inputs; fixtures on the real services (tests/harness/fixtures.py)."""

from tests.harness.fixtures import pg_url, service_env, sqlite_url, store  # noqa: F401
