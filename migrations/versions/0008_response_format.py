"""requests.response_format: the JSON schema a row's output must follow (a line's `response_format`,
json_object as the flat object of scalars); null for free text

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 18:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("response_format", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("requests", "response_format")
