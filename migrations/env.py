"""Alembic environment: the URL comes from the caller (canvasq.core.store.alembic_config) or
CANVASQ_DATABASE_URL; SQLite runs in batch mode (ALTER through table copy)."""

from __future__ import annotations

from alembic import context

from canvasq.core.db import make_engine
from canvasq.core.settings import get_settings
from canvasq.core.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("canvasq_url") or get_settings().database_url


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata,
                              render_as_batch=connection.dialect.name == "sqlite")
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
