"""Tests of the compose file and a fleet over TLS; fixtures on the real services (tests/harness/fixtures.py)."""

from tests.harness.fixtures import pg_url, service_env, sqlite_url, store  # noqa: F401
