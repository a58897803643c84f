"""Fair use: a priority band per tenant, the feeder's queue indexed per tenant, and the
index the per-tenant cap on unfinished batch lines counts with.

Revision ID: 20261201_0010
Revises: 0004
Create Date: 2026-12-01 05:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0010"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNDISPATCHED = "status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"
ACTIVE_LINES = "status IN ('queued','running') AND batch_id IS NOT NULL"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("priority_min", sa.Integer(), server_default="0", nullable=False))
    op.add_column("tenants", sa.Column("priority_max", sa.Integer(), server_default="100", nullable=False))
    op.create_check_constraint(op.f("ck_tenants_priority_band"), "tenants", "priority_min <= priority_max")
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "tenant_id", "priority", "batch_id", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )
    op.create_index(
        "ix_jobs_tenant_active_lines",
        "jobs",
        ["tenant_id"],
        unique=False,
        postgresql_where=sa.text(ACTIVE_LINES),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_active_lines", table_name="jobs", postgresql_where=sa.text(ACTIVE_LINES))
    op.drop_index("ix_jobs_undispatched", table_name="jobs", postgresql_where=sa.text(UNDISPATCHED))
    op.create_index(
        "ix_jobs_undispatched",
        "jobs",
        ["model", "priority", "batch_id", "line_no"],
        unique=False,
        postgresql_where=sa.text(UNDISPATCHED),
    )
    op.drop_constraint(op.f("ck_tenants_priority_band"), "tenants", type_="check")
    op.drop_column("tenants", "priority_max")
    op.drop_column("tenants", "priority_min")
