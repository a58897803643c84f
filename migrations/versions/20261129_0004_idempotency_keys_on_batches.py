"""Idempotency keys on batches (unique per tenant), and the index the per-tenant cap on
active single jobs counts with.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 14:43:54.448438
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('idempotency_key', sa.String(length=256), nullable=True))
    op.add_column('batches', sa.Column('request_hash', sa.String(length=64), nullable=True))
    op.create_unique_constraint('uq_batches_tenant_idempotency', 'batches', ['tenant_id', 'idempotency_key'])
    op.create_index('ix_jobs_tenant_active', 'jobs', ['tenant_id'], unique=False, postgresql_where=sa.text("status IN ('queued','running') AND batch_id IS NULL"))


def downgrade() -> None:
    op.drop_index('ix_jobs_tenant_active', table_name='jobs', postgresql_where=sa.text("status IN ('queued','running') AND batch_id IS NULL"))
    op.drop_constraint('uq_batches_tenant_idempotency', 'batches', type_='unique')
    op.drop_column('batches', 'request_hash')
    op.drop_column('batches', 'idempotency_key')
