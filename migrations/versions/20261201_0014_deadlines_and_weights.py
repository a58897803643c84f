"""Deadlines and weighted fair share: each batch line carries its batch's deadline, the
feeder's queue is ordered by it within a tenant, and each tenant has a fair-share weight.

Revision ID: 20261201_0014
Revises: 20261201_0010
Create Date: 2026-12-01 09:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0014"
down_revision: str | None = "20261201_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNDISPATCHED = "status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE jobs SET deadline_at = b.expires_at FROM batches b "
        "WHERE b.id = jobs.batch_id AND jobs.status IN ('queued', 'running')"
    )
    op.add_column("tenants", sa.Column("share_weight", sa.Float(), server_default="1", nullable=False))
    op.create_check_constraint(op.f("ck_tenants_share_weight_positive"), "tenants", "share_weight > 0")
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "tenant_id", "priority", "deadline_at", "batch_id", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "tenant_id", "priority", "batch_id", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )
    op.drop_constraint(op.f("ck_tenants_share_weight_positive"), "tenants", type_="check")
    op.drop_column("tenants", "share_weight")
    op.drop_column("jobs", "deadline_at")
