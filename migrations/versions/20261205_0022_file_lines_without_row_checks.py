"""An input file's lines are deleted with their file by a trigger, not checked against it
row by row.

`file_lines.file_id` referenced `files.id`: Postgres checked that reference once for every
line an upload's COPY wrote, in a queue of checks run after the COPY's last row (50,000
lines: 0.21 s of the upload's 1.1 s, spent while the API waited). Lines are written by one
path only (app/services/files.py's `store_lines`), in the transaction that inserts their
file's row, so a line without its file cannot be written. What the reference also did,
deleting a file's lines with it (a file expired or deleted, or its tenant deleted), is
kept by an AFTER DELETE trigger on `files`.

Revision ID: 20261205_0022
Revises: 20261203_0021
Create Date: 2026-12-05 08:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "20261205_0022"
down_revision: str | None = "20261203_0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FOREIGN_KEY = "fk_file_lines_file_id_files"


def upgrade() -> None:
    op.drop_constraint(FOREIGN_KEY, "file_lines", type_="foreignkey")
    op.execute(
        """
        CREATE FUNCTION llmq_file_lines_follow_file() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          DELETE FROM file_lines WHERE file_id = OLD.id;
          RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER files_delete_lines AFTER DELETE ON files FOR EACH ROW "
        "EXECUTE FUNCTION llmq_file_lines_follow_file()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER files_delete_lines ON files")
    op.execute("DROP FUNCTION llmq_file_lines_follow_file()")
    # Lines whose file is gone (none, while the trigger held) would fail the check.
    op.execute("DELETE FROM file_lines WHERE file_id NOT IN (SELECT id FROM files)")
    op.create_foreign_key(FOREIGN_KEY, "file_lines", "files", ["file_id"], ["id"], ondelete="CASCADE")
