"""`Database.returning`: one statement that is a whole transaction, run on the pooled
connection's psycopg cursor (the worker's claim and result write, worker/store.py). Its rows
come back as tuples and its write is committed; a failed statement raises SQLAlchemy's error
and leaves the connection usable; a broken one is replaced; with tracing on it has its span."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError, OperationalError

from app.connections import PoolSize
from app.db import Database
from tests.helpers import Stores, back_in_the_pool_as_lent, cut_pooled_connections, statements_of, tracing_on

INSERT = text("INSERT INTO tenants (id, name) VALUES (:t, :name) RETURNING id, name, created_at IS NOT NULL")
RENAME = text("UPDATE tenants SET name = :name WHERE id = :t")


def open_db(stores: Stores, connections: int = 1) -> Database:
    return Database.from_url(
        stores.database_url,
        PoolSize(pool=connections, overflow=0),
        transaction_pooler=stores.pooler != "none",
    )


@pytest.fixture
def db(stores: Stores) -> Iterator[Database]:
    """A pool of one connection: what a test breaks is what the next statement gets back."""
    database = open_db(stores)
    yield database
    database.dispose()


def name_of(db: Database, tenant: str) -> str | None:
    with db.reading() as s:
        return s.scalar(text("SELECT name FROM tenants WHERE id = :t"), {"t": tenant})


def test_rows_come_back_as_tuples_and_the_write_is_committed(stores: Stores, db: Database) -> None:
    tenant = f"tenant-returning-{secrets.token_hex(3)}"
    hostile = "it's %(t)s %s $1 ?; DROP TABLE tenants; --"
    assert db.returning(INSERT, {"t": tenant, "name": hostile}) == [(tenant, hostile, True)]
    assert db.returning(RENAME, {"t": tenant, "name": "renamed"}) == []  # no RETURNING: no rows
    assert name_of(db, tenant) == "renamed"  # read on the same (only) connection, committed
    back_in_the_pool_as_lent(db)
    other = open_db(stores)
    try:
        assert name_of(other, tenant) == "renamed"  # and seen by another connection
    finally:
        other.dispose()


def test_it_is_one_execute_on_the_driver(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Session, no SQLAlchemy cursor event: one psycopg execute, with the statement
    compiled to psycopg's placeholders and the values bound by psycopg."""
    through_sqlalchemy: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        through_sqlalchemy.append(statement)

    sent: list[tuple[Any, Any]] = []
    execute = psycopg.Cursor.execute

    def recorded(self: psycopg.Cursor[Any], query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append((query, params))
        return execute(self, query, params, **kw)

    db.returning(RENAME, {"t": "nobody", "name": "n"})  # the pool's connection opened first
    event.listen(db.engine, "before_cursor_execute", before)
    monkeypatch.setattr(psycopg.Cursor, "execute", recorded)
    try:
        tenant = f"tenant-returning-{secrets.token_hex(3)}"
        db.returning(INSERT, {"t": tenant, "name": "n"})
    finally:
        event.remove(db.engine, "before_cursor_execute", before)
    assert through_sqlalchemy == []
    assert sent == [(sent[0][0], {"t": tenant, "name": "n"})]
    assert "VALUES (%(t)s, %(name)s)" in sent[0][0]


def test_a_failed_statement_raises_sqlalchemys_error_and_the_connection_serves_the_next(db: Database) -> None:
    tenant = f"tenant-returning-{secrets.token_hex(3)}"
    db.returning(INSERT, {"t": tenant, "name": "first"})
    with pytest.raises(IntegrityError) as failed:
        db.returning(INSERT, {"t": tenant, "name": "second"})
    assert "second" not in str(failed.value)  # values hidden from the error's text
    back_in_the_pool_as_lent(db)
    assert db.returning(RENAME, {"t": tenant, "name": "third"}) == []
    assert name_of(db, tenant) == "third"


def test_after_a_broken_connection_the_next_statement_gets_a_live_one(stores: Stores) -> None:
    """Both pooled connections die (as a Postgres restart leaves them): the first statement
    fails, and the pool replaces the other one too, as SQLAlchemy's own execute would."""
    db = open_db(stores, connections=2)
    try:
        cut_pooled_connections(db, 2)
        tenant = f"tenant-returning-{secrets.token_hex(3)}"
        with pytest.raises(OperationalError) as failed:
            db.returning(INSERT, {"t": tenant, "name": "lost"})
        assert failed.value.connection_invalidated
        assert db.returning(INSERT, {"t": tenant, "name": "kept"}) == [(tenant, "kept", True)]
        assert db.returning(RENAME, {"t": tenant, "name": "kept again"}) == []
    finally:
        db.dispose()


def test_with_tracing_on_the_statement_has_its_span(stores: Stores, db: Database) -> None:
    tenant = f"tenant-returning-{secrets.token_hex(3)}"
    with tracing_on() as exporter:
        traced = open_db(stores)  # instrumented: created while tracing is on
        try:
            assert traced.returning(INSERT, {"t": tenant, "name": "traced"}) == [(tenant, "traced", True)]
            assert traced.returning(RENAME, {"t": tenant, "name": "traced again"}) == []
        finally:
            traced.dispose()
    statements = statements_of(exporter)
    assert any(s.startswith("INSERT INTO tenants") for s in statements), statements
    assert name_of(db, tenant) == "traced again"


def closed_port() -> int:
    """A port nothing listens on (bound for a moment, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_database_that_cannot_be_reached_raises_sqlalchemys_error(stores: Stores) -> None:
    """Postgres down when the pool opens a connection (a restart under way): SQLAlchemy's
    OperationalError, as its own execute raises it, which the worker's write retries catch,
    for `returning` and for `at_once` alike."""
    db = Database.from_url(
        f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres", PoolSize(pool=1, overflow=0)
    )
    try:
        with pytest.raises(OperationalError):
            db.returning(RENAME, {"t": "nobody", "name": "n"})
        with pytest.raises(OperationalError):
            db.at_once([("SELECT 1", {})])
    finally:
        db.dispose()
