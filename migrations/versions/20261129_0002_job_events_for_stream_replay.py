"""A job's stream events, persisted when it ends, so SSE replays after Redis lets them go.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:55:21.138321
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('events', sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column('jobs', 'events')
