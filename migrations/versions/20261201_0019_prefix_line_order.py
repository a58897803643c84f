"""Prefix-aware line order: each batch line's prefix key, the order a batch asked for, and
the feeder's index with the key before the line number (app/domain/line_order.py).

Lines queued before this revision have no key and keep line order.

Revision ID: 20261201_0019
Revises: 20261201_0018
Create Date: 2026-12-01 12:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0019"
down_revision: str | None = "20261201_0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNDISPATCHED = "status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("prefix_key", sa.Text(), nullable=True))
    op.add_column(
        "batches", sa.Column("line_order", sa.String(length=16), server_default="prefix", nullable=False)
    )
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "tenant_id", "priority", "deadline_at", "batch_id", "prefix_key", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "tenant_id", "priority", "deadline_at", "batch_id", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )
    op.drop_column("batches", "line_order")
    op.drop_column("jobs", "prefix_key")
