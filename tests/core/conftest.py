"""Tests of the ground floor: store, leases, migrations, settings; fixtures on the real services (tests/harness/fixtures.py)."""

from tests.harness.fixtures import pg_url, service_env, sqlite_url, store  # noqa: F401
