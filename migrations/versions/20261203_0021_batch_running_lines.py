"""A batch's running lines: what `GET /v1/batches/<id>` counts on every poll.

`ix_jobs_batch_running` is on `batch_id` for running jobs only, so counting a batch's
running lines reads those lines and nothing else (the feeder's window bounds them),
however many lines the batch and the table hold (app/services/batch_counts.py). Built
CONCURRENTLY (outside the migration's transaction): the jobs table is written all the time
and a plain build would block it.

Revision ID: 20261203_0021
Revises: 20261201_0019
Create Date: 2026-12-03 19:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261203_0021"
down_revision: str | None = "20261201_0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNING = "status = 'running'"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_jobs_batch_running",
            "jobs",
            ["batch_id"],
            unique=False,
            postgresql_where=sa.text(RUNNING),
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_jobs_batch_running",
            table_name="jobs",
            postgresql_where=sa.text(RUNNING),
            postgresql_concurrently=True,
            if_exists=True,
        )
