"""Jobs by the time they ended, per tenant: what `GET /v2/throughput` reads.

`ix_jobs_tenant_ended` is on `(tenant_id, GREATEST(succeeded_at, failed_at, cancelled_at,
expired_at))` for terminal jobs only, so an hour of a tenant's finished jobs is a range
scan however many jobs the table holds. Built CONCURRENTLY (outside the migration's
transaction): the jobs table is written all the time and a plain build would block it.

Revision ID: 20261201_0020
Revises: 20261201_0016
Create Date: 2026-12-01 12:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0020"
down_revision: str | None = "20261201_0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENDED_AT = "GREATEST(succeeded_at, failed_at, cancelled_at, expired_at)"
TERMINAL = "status IN ('succeeded','failed','cancelled','expired')"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_jobs_tenant_ended",
            "jobs",
            ["tenant_id", sa.literal_column(ENDED_AT).label("ended_at")],
            unique=False,
            postgresql_where=sa.text(TERMINAL),
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_jobs_tenant_ended",
            table_name="jobs",
            postgresql_where=sa.text(TERMINAL),
            postgresql_concurrently=True,
            if_exists=True,
        )
