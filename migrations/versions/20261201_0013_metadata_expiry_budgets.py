"""Metadata filters (GIN indexes on jobs' and batches' metadata), file expiry (`expires_at`
on files, `output_expires_after` on batches) and batch token budgets (per tenant, with each
input line's and each batch line's figure stored so a line's end releases it exactly).

Revision ID: 20261201_0013
Revises: 20261201_0014
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0013"
down_revision: str | None = "20261201_0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HAS_METADATA = "metadata IS NOT NULL"
EXPIRES = "expires_at IS NOT NULL"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("batch_token_budget", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("budget_tokens", sa.Integer(), nullable=True))
    op.add_column("file_lines", sa.Column("tokens", sa.Integer(), nullable=True))
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("batches", sa.Column("output_expires_after", sa.Integer(), nullable=True))
    op.create_index(
        "ix_files_expires_at", "files", ["expires_at"], unique=False, postgresql_where=sa.text(EXPIRES)
    )
    # `json` keeps text exactly as given; the filters need `jsonb`'s containment. Metadata is
    # validated to string pairs without U+0000, so the cast cannot fail on what the API stores.
    for table in ("jobs", "batches"):
        op.create_index(
            f"ix_{table}_metadata",
            table,
            [sa.literal_column("(metadata::jsonb)").label("metadata_jsonb")],
            unique=False,
            postgresql_using="gin",
            postgresql_ops={"metadata_jsonb": "jsonb_path_ops"},
            postgresql_where=sa.text(HAS_METADATA),
        )


def downgrade() -> None:
    for table in ("batches", "jobs"):
        op.drop_index(f"ix_{table}_metadata", table_name=table, postgresql_where=sa.text(HAS_METADATA))
    op.drop_index("ix_files_expires_at", table_name="files", postgresql_where=sa.text(EXPIRES))
    op.drop_column("batches", "output_expires_after")
    op.drop_column("files", "expires_at")
    op.drop_column("file_lines", "tokens")
    op.drop_column("jobs", "budget_tokens")
    op.drop_column("tenants", "batch_token_budget")
