"""requests.stop: a request's stop sequences (OpenAI `stop`), applied to its text on export;
runs.chunk_size: the rows per chunk it was created with (`retry` re-chunks with it)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ... ADD COLUMN on both dialects: no table copy (see downgrade)
    op.add_column("requests", sa.Column("stop", sa.JSON(), nullable=True))
    op.add_column("runs", sa.Column("chunk_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not a batch table copy: dropping the copied
    # `runs` or `requests` would cascade (ON DELETE CASCADE) to every row that points at them.
    op.drop_column("runs", "chunk_size")
    op.drop_column("requests", "stop")
