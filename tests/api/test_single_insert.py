"""A single job's insert (app/services/quotas.py): one round trip far from the cap
(`Database.at_once`), the exclusive count near it, SQLAlchemy's statements with tracing on.
Whichever path writes it, the row reads back the same; a broken connection or a failed
statement leaves the pool usable. The cap's exactness under concurrency: test_limits.py."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from app import jsontext
from app.connections import PoolSize
from app.db import Database
from app.errors import RateLimited
from app.ids import new_id
from app.services.keys import KeyService
from app.services.quotas import insert_single_job
from tests.helpers import Stores, back_in_the_pool_as_lent, cut_pooled_connections, statements_of, tracing_on


@pytest.fixture
def db(stores: Stores) -> Iterator[Database]:
    """A pool of one connection: what a test breaks is what the next insert gets back."""
    database = Database.from_url(
        stores.database_url, PoolSize(pool=1, overflow=0), transaction_pooler=stores.pooler != "none"
    )
    yield database
    database.dispose()


@pytest.fixture
def tenant(db: Database) -> str:
    keys = KeyService(db)
    return keys.ensure_tenant(f"tenant-insert-{secrets.token_hex(3)}")


def row(tenant_id: str, **values: Any) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "id": new_id("job"),
        "tenant_id": tenant_id,
        "kind": "chat",
        "status": "queued",
        "priority": 3,
        "model": "api-only",
        "request": {"model": "api-only", "messages": [{"role": "user", "content": "héllo \u2028 there"}]},
        "metadata": None,
        "attempts": 0,
        "epoch": 0,
        "created_at": now,
        "enqueued_at": now,
        "idempotency_key": None,
        "request_hash": None,
        "request_id": "req-1",
        **values,
    }


def stored(db: Database, job_id: str) -> dict[str, Any]:
    """The row as Postgres has it, every column, its id left out."""
    with db.reading() as s:
        found = s.execute(
            text("SELECT to_jsonb(j) - 'id' FROM jobs j WHERE id = :id"), {"id": job_id}
        ).scalar_one()
    assert isinstance(found, dict)
    return found


def active(db: Database, tenant_id: str) -> int:
    with db.reading() as s:
        return int(s.scalar(text("SELECT count(*) FROM jobs WHERE tenant_id = :t"), {"t": tenant_id}) or 0)


def max_connections(db: Database) -> int:
    with db.reading() as s:
        return int(s.scalar(text("SELECT current_setting('max_connections')::int")) or 0)


@pytest.mark.parametrize("metadata", [None, {"team": "search", "n": "1"}])
def test_every_path_stores_the_same_row(db: Database, tenant: str, metadata: dict[str, str] | None) -> None:
    """Far from the cap (one round trip), near it (exclusive lock, SQLAlchemy's INSERT) and
    with no cap: the same values give the same stored row, JSON `null` for no metadata
    included (as SQLAlchemy writes a JSON column's None)."""
    near = max_connections(db)  # fewer places left than max_connections: the exclusive path
    same = row(tenant, metadata=metadata)
    far, close, uncapped = ({**same, "id": new_id("job")} for _ in range(3))
    insert_single_job(db, tenant, 10**6, far)
    insert_single_job(db, tenant, near, close)
    insert_single_job(db, tenant, 0, uncapped)
    rows = [stored(db, r["id"]) for r in (far, close, uncapped)]
    assert rows[0] == rows[1] == rows[2]
    assert rows[0]["metadata"] == metadata and rows[0]["priority"] == 3
    assert rows[0]["request"]["messages"][0]["content"] == "héllo \u2028 there"


def test_every_path_writes_json_as_the_worker_does(db: Database, tenant: str) -> None:
    """A request's text in its json column is the same compact UTF-8 whichever path wrote
    it, as the worker writes a result's documents (app/jsontext.py): not json.dumps's
    spaced, ASCII-escaped text."""
    near = max_connections(db)
    same = row(tenant)
    rows = [{**same, "id": new_id("job")} for _ in range(3)]
    for cap, one in zip((10**6, near, 0), rows, strict=True):
        insert_single_job(db, tenant, cap, one)
    with db.reading() as s:
        texts = {
            s.execute(text("SELECT request::text FROM jobs WHERE id = :id"), {"id": one["id"]}).scalar_one()
            for one in rows
        }
    assert texts == {jsontext.compact(same["request"])}
    assert "héllo \u2028 there" in next(iter(texts))


HOSTILE = "it's \\' \"q\" %(tenant_id)s %s $1 ?; DROP TABLE jobs; -- \x01 E'\\x' \U0001f600"


def test_values_are_stored_exactly_whatever_they_hold(db: Database, tenant: str) -> None:
    """Values are bound on this side into the one string: quotes, backslashes, placeholders
    of either style, a statement separator and control characters are stored as sent, and
    nothing in them runs. (A request may hold U+0000; metadata, stored as jsonb too, may
    not: the API refuses it before any insert.)"""
    hostile = row(
        tenant,
        request={"model": "api-only", "messages": [{"role": "user", "content": HOSTILE + "\u0000"}]},
        metadata={"k": HOSTILE},
        request_id=HOSTILE,
        idempotency_key=HOSTILE,
    )
    insert_single_job(db, tenant, 10**6, hostile)
    with db.reading() as s:
        got = s.execute(
            text(
                "SELECT request::text AS request, metadata, request_id, idempotency_key "
                "FROM jobs WHERE id = :id"
            ),
            {"id": hostile["id"]},
        ).one()
    assert json.loads(got.request)["messages"][0]["content"] == HOSTILE + "\u0000"
    assert got.metadata == {"k": HOSTILE}
    assert got.request_id == hostile["request_id"]
    assert got.idempotency_key == hostile["idempotency_key"]
    assert active(db, tenant) == 1


def test_the_cap_holds_on_both_paths(db: Database, tenant: str) -> None:
    near = max_connections(db) + 2  # two places on the shared path, then exact counts
    for _ in range(near):
        insert_single_job(db, tenant, near, row(tenant))
    with pytest.raises(RateLimited):
        insert_single_job(db, tenant, near, row(tenant))
    assert active(db, tenant) == near


def test_a_value_too_long_is_refused_not_cut_short(db: Database, tenant: str) -> None:
    """The casts carry no length: Postgres refuses a 300-character model name for a
    VARCHAR(256) column where an explicit `::VARCHAR(256)` would silently cut it."""
    with pytest.raises(Exception, match="too long"):
        insert_single_job(db, tenant, 10**6, row(tenant, model="m" * 300))
    assert active(db, tenant) == 0


def test_after_a_broken_connection_the_next_insert_gets_a_live_one(stores: Stores, tenant: str) -> None:
    """Both pooled connections die (as a Postgres restart leaves them): the first insert
    fails, and the pool replaces the other one too, as SQLAlchemy's own execute would have
    it, so the next insert does not fail on it."""
    db = Database.from_url(
        stores.database_url, PoolSize(pool=2, overflow=0), transaction_pooler=stores.pooler != "none"
    )
    try:
        cut_pooled_connections(db, 2)
        with pytest.raises(OperationalError) as failed:
            insert_single_job(db, tenant, 10**6, row(tenant))
        assert failed.value.connection_invalidated
        insert_single_job(db, tenant, 10**6, row(tenant))
        insert_single_job(db, tenant, 10**6, row(tenant))
        assert active(db, tenant) == 2
    finally:
        db.dispose()


def test_a_failed_statement_rolls_back_and_leaves_the_connection_usable(db: Database, tenant: str) -> None:
    """An unknown tenant fails the foreign key inside the pipeline: SQLAlchemy's error, no
    row, and the same (only) connection serves the next insert, the lock released."""
    with pytest.raises(IntegrityError):
        insert_single_job(db, "no-such-tenant", 10**6, row("no-such-tenant"))
    insert_single_job(db, tenant, 10**6, row(tenant))
    insert_single_job(db, tenant, max_connections(db), row(tenant))  # the exclusive lock is free
    assert active(db, tenant) == 2


def test_the_statements_are_one_transaction_after_a_read_in_autocommit(db: Database) -> None:
    """The pool's one connection was just lent in autocommit (a poll's read): the one string's
    statements still run as one transaction, so a failure in the second undoes the first
    (and a lock taken by the first would hold for the second)."""
    with db.reading() as s:
        assert s.scalar(text("SELECT 1")) == 1
    name = f"tenant-atomic-{secrets.token_hex(3)}"
    with pytest.raises(IntegrityError):
        db.at_once(
            [
                ("INSERT INTO tenants (id, name) VALUES (%(t)s, %(t)s)", {"t": name}),
                ("INSERT INTO tenants (id, name) VALUES (%(t)s, %(t)s)", {"t": name}),
            ]
        )
    with db.reading() as s:
        assert s.scalar(text("SELECT count(*) FROM tenants WHERE id = :t"), {"t": name}) == 0


def test_the_transaction_is_one_round_trip(
    db: Database, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock and the insert go as one string, sent once and answered in one flight (the
    pipeline mode used before waited on the socket once per statement); the connection goes
    back to the pool out of autocommit, after a success and after a failure."""
    sent: list[tuple[Any, Any]] = []
    execute = psycopg.Cursor.execute

    def recorded(self: psycopg.Cursor[Any], query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append((query, params))
        return execute(self, query, params, **kw)

    monkeypatch.setattr(psycopg.Cursor, "execute", recorded)  # ClientCursor's too
    insert_single_job(db, tenant, 10**6, row(tenant))
    assert len(sent) == 1
    query, params = sent[0]
    assert params is None
    assert query.startswith("SELECT pg_advisory_xact_lock_shared(") and "; INSERT INTO jobs " in query
    assert active(db, tenant) == 1
    with pytest.raises(IntegrityError):
        insert_single_job(db, "no-such-tenant", 10**6, row("no-such-tenant"))
    back_in_the_pool_as_lent(db)


def test_with_tracing_on_each_statement_has_its_span(stores: Stores, db: Database, tenant: str) -> None:
    with tracing_on() as exporter:
        traced = Database.from_url(
            stores.database_url, PoolSize(pool=1, overflow=0), transaction_pooler=stores.pooler != "none"
        )
        try:
            job = row(tenant)
            insert_single_job(traced, tenant, 10**6, job)
        finally:
            traced.dispose()
    statements = statements_of(exporter)
    assert any(s.startswith("SELECT pg_advisory_xact_lock_shared") for s in statements), statements
    assert any(s.startswith("INSERT INTO jobs") for s in statements), statements
    assert stored(db, job["id"])["tenant_id"] == tenant
