"""Results while running: each batch line records the transaction that ended it.

`jobs.finished_xid` is the id (xid8, as bigint) of the transaction that moved a batch line
into a terminal state, set by a trigger so that every path that ends a line (the worker's
result, a cancel, expiry, the sweeper giving up, and any added later) sets it the same way.
`(finished_xid, line_no)` is the cursor of `GET /v1/batches/<id>/results`; why a
transaction id and not a sequence is explained in app/services/results.py.

Lines that ended before this migration get 0: they sort first, in line order.

Revision ID: 20261201_0012
Revises: 20261201_0011
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0012"
down_revision: str | None = "20261201_0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINISHED = "finished_xid IS NOT NULL"
TERMINAL = "('succeeded','failed','cancelled','expired')"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("finished_xid", sa.BigInteger(), nullable=True))
    op.execute(f"UPDATE jobs SET finished_xid = 0 WHERE batch_id IS NOT NULL AND status IN {TERMINAL}")
    op.create_index(
        "ix_jobs_batch_finished",
        "jobs",
        ["batch_id", "finished_xid", "line_no"],
        unique=False,
        postgresql_where=sa.text(FINISHED),
    )
    # The conditions are the triggers' WHEN clauses, so that the function runs only for
    # the rows it changes (a batch's creation inserts thousands of queued lines at once).
    op.execute(
        """
        CREATE FUNCTION llmq_jobs_finished_xid() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          NEW.finished_xid := pg_current_xact_id()::text::bigint;
          RETURN NEW;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER jobs_finished_xid_insert BEFORE INSERT ON jobs FOR EACH ROW "
        f"WHEN (NEW.batch_id IS NOT NULL AND NEW.status IN {TERMINAL}) "
        "EXECUTE FUNCTION llmq_jobs_finished_xid()"
    )
    op.execute(
        "CREATE TRIGGER jobs_finished_xid_update BEFORE UPDATE OF status ON jobs FOR EACH ROW "
        f"WHEN (NEW.batch_id IS NOT NULL AND NEW.status IN {TERMINAL} AND OLD.status NOT IN {TERMINAL}) "
        "EXECUTE FUNCTION llmq_jobs_finished_xid()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_finished_xid_update ON jobs")
    op.execute("DROP TRIGGER jobs_finished_xid_insert ON jobs")
    op.execute("DROP FUNCTION llmq_jobs_finished_xid()")
    op.drop_index("ix_jobs_batch_finished", table_name="jobs", postgresql_where=sa.text(FINISHED))
    op.drop_column("jobs", "finished_xid")
