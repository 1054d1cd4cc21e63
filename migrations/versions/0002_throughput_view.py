"""chunks.last_error (batch ALTER on SQLite) and the run_throughput view

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 23:25:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Throughput per run and decoder, from rows (never counters). Same SQL on SQLite and PostgreSQL.
VIEW = """
CREATE VIEW run_throughput AS
SELECT run_id, decoder, COUNT(*) AS requests,
       SUM(completion_tokens) AS tokens, SUM(forwards) AS forwards, SUM(gen_ms) AS gen_ms
FROM outputs WHERE error_code IS NULL
GROUP BY run_id, decoder
"""


def upgrade() -> None:
    with op.batch_alter_table("chunks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_error", sa.Text(), nullable=True))
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS run_throughput")
    with op.batch_alter_table("chunks", schema=None) as batch_op:
        batch_op.drop_column("last_error")
