"""Migrations: upgrade on an empty database, models match (`alembic check`), downgrade works."""

from __future__ import annotations

import base64
import json
import os
import secrets
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config

from app.cli.stack import REPO_ROOT
from tests.helpers import Stores


def _config(url: str) -> Config:
    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.attributes["url"] = url
    cfg.attributes["configure_logger"] = False
    return cfg


def test_models_match_the_migrations(stores: Stores) -> None:
    command.check(_config(stores.database_url))  # raises if autogenerate finds a difference


def test_upgrade_downgrade_upgrade_on_an_empty_database(stores: Stores) -> None:
    admin = stores.database_url.rsplit("/", 1)[0] + "/postgres"
    name = f"llmq_mig_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = admin.rsplit("/", 1)[0] + f"/{name}"
    try:
        cfg = _config(url)
        command.upgrade(cfg, "head")
        command.downgrade(cfg, "base")
        command.upgrade(cfg, "head")
        command.check(cfg)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_finished_row_of_3_kb_stays_whole_in_its_page(stores: Stores) -> None:
    """A short completion's row (its response and events about 2-4 KB) is written whole into
    the heap (migration 0023): past Postgres's default target of 2032 bytes its events went
    to the TOAST relation, a second write for every finished batch line. The events here are
    random text that compression cannot shrink, so only the target keeps them inline; a row
    past 4080 bytes is still moved out as before."""
    suffix = secrets.token_hex(4)
    tenant, job, big_job = f"toast-{suffix}", f"job_toast_{suffix}", f"job_toast_big_{suffix}"

    def events(chars: int) -> str:
        text = base64.b64encode(os.urandom(chars * 3 // 4)).decode()
        return json.dumps([{"id": "1-1", "type": "chunk", "data": text}])

    with psycopg.connect(stores.database_url, autocommit=True) as conn:

        def one(sql: str, params: tuple[str, ...] = ()) -> Any:
            row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
            assert row is not None
            return row[0]

        toast = one("SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = 'jobs'")

        def toasted() -> int:
            return int(one(f"SELECT count(*) FROM {toast}"))

        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, tenant))
        try:
            for job_id in (job, big_job):
                insert = "INSERT INTO jobs (id, tenant_id, model, request) VALUES (%s, %s, 'm', '{}')"
                conn.execute(insert, (job_id, tenant))
            before = toasted()
            conn.execute("UPDATE jobs SET events = %s WHERE id = %s", (events(2_800), job))
            assert one("SELECT pg_column_size(j.*) FROM jobs j WHERE id = %s", (job,)) > 2_032
            assert toasted() == before, "a 3 KB row's events went to the TOAST relation"
            conn.execute("UPDATE jobs SET events = %s WHERE id = %s", (events(6_000), big_job))
            assert toasted() > before, "a 6 KB row should still be moved out of its page"
        finally:
            conn.execute("DELETE FROM tenants WHERE id = %s", (tenant,))


def test_the_jobs_unique_indexes_hold_only_the_rows_they_constrain(stores: Stores) -> None:
    """(tenant, idempotency key) and (batch, line number) stay unique where both are set,
    and rows without them (most jobs have no idempotency key; a single job is no batch
    line) have no entry to write in either (migration 0024)."""
    suffix = secrets.token_hex(4)
    tenant = f"uq-{suffix}"
    insert = (
        "INSERT INTO jobs (id, tenant_id, model, request, idempotency_key, batch_id, line_no) "
        "VALUES (%s, %s, 'm', '{}', %s, %s, %s)"
    )
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, tenant))
        try:
            for i in range(3):  # neither value: any number of them
                conn.execute(insert, (f"job_plain_{suffix}_{i}", tenant, None, None, None))
            conn.execute(insert, (f"job_key_{suffix}", tenant, "k", None, None))
            conn.execute(insert, (f"job_line_{suffix}", tenant, None, f"batch_{suffix}", 0))
            for job_id, key, batch in (
                (f"job_key2_{suffix}", "k", None),
                (f"job_line2_{suffix}", None, f"batch_{suffix}"),
            ):
                with pytest.raises(psycopg.errors.UniqueViolation):
                    conn.execute(insert, (job_id, tenant, key, batch, 0 if batch else None))
            predicates = dict(
                conn.execute(
                    "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE c.relname IN ('uq_jobs_tenant_idempotency', 'uq_jobs_batch_line')"
                ).fetchall()
            )
            assert predicates == {
                "uq_jobs_tenant_idempotency": "(idempotency_key IS NOT NULL)",
                "uq_jobs_batch_line": "(batch_id IS NOT NULL)",
            }
        finally:
            conn.execute("DELETE FROM tenants WHERE id = %s", (tenant,))
