"""Requests that only read run their statements in autocommit (`Database.reading`): no
BEGIN and no COMMIT round trip around a poll's one SELECT. The pool's connections go back
to transactions afterwards, so a write still commits or rolls back as one."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import event, text

from app.connections import ADMIN_POOL
from app.container import Services
from app.db import Database
from app.queue import WAKE_KEY
from app.services.batch_lifecycle import BatchLifecycle
from tests.helpers import Stores, auth, create, fresh_database, jsonl, line, upload


@pytest.fixture
def statements(services: Services) -> Iterator[list[tuple[str, bool]]]:
    """(statement, whether its connection was in autocommit) of each statement run."""
    seen: list[tuple[str, bool]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(
            (statement.split(maxsplit=1)[0].upper(), bool(conn.connection.dbapi_connection.autocommit))
        )

    event.listen(services.db.engine, "before_cursor_execute", before)
    yield seen
    event.remove(services.db.engine, "before_cursor_execute", before)


def test_a_poll_reads_in_autocommit_and_a_write_is_still_one_transaction(
    client: FlaskClient, services: Services, statements: list[tuple[str, bool]]
) -> None:
    key = services.keys.create_key(f"tenant-reads-{secrets.token_hex(3)}")
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200  # the key is cached now
    statements.clear()
    body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    job_id = client.post("/v2/jobs", json=body, headers=auth(key)).get_json()["id"]
    # The submit's transaction went as one pipelined round trip, past SQLAlchemy's execute
    # (`Database.at_once`, tests/api/test_single_insert.py).
    assert statements == []

    for path in (f"/v2/jobs/{job_id}", "/v2/jobs", f"/v2/jobs/{job_id}/request"):
        statements.clear()
        assert client.get(path, headers=auth(key)).status_code == 200
        assert statements and all(autocommit for _, autocommit in statements), (path, statements)

    # The same pooled connections, back in transactions: a write that fails leaves nothing.
    marker = f"tenant-rollback-{secrets.token_hex(3)}"
    with pytest.raises(RuntimeError), services.db.session() as s:
        s.execute(text("INSERT INTO tenants (id, name) VALUES (:t, :t)"), {"t": marker})
        raise RuntimeError("the caller fails after its insert")
    with services.db.session() as s:
        assert s.scalar(text("SELECT count(*) FROM tenants WHERE id = :t"), {"t": marker}) == 0


def test_the_feeders_look_for_owed_lines_is_one_read_in_autocommit(
    services: Services, statements: list[tuple[str, bool]]
) -> None:
    """The batch feeder runs every 0.2 s on every worker, and most rounds find nothing owed:
    that look is one SELECT in autocommit, no BEGIN or COMMIT round trip (window 0: no
    room, so nothing is taken or sent whatever other tests left owed)."""
    BatchLifecycle(services.db, services.queue, services.events, window=0, chunk=8).feed()
    assert statements and statements[0] == ("WITH", True), statements


def test_the_feeders_idle_probe_is_one_read_and_sees_an_active_batch(
    client: FlaskClient, services: Services, stores: Stores, statements: list[tuple[str, bool]]
) -> None:
    """A round with no batch active stops at `any_active`: one SELECT in autocommit, false
    on a database without batches and true once one is in progress; creating the batch
    woke the feeder."""
    fresh = Database.from_url(fresh_database(stores), ADMIN_POOL)
    try:
        assert BatchLifecycle(fresh, services.queue, services.events, chunk=8).any_active() is False
    finally:
        fresh.dispose()
    key = services.keys.create_key(f"tenant-idle-{secrets.token_hex(3)}")
    file_id = upload(client, key, jsonl([line(0, model="api-only")])).get_json()["id"]
    services.redis.delete(WAKE_KEY)
    assert create(client, key, file_id).status_code == 200  # no worker serves api-only: it stays in progress
    assert services.redis.llen(WAKE_KEY) == 1  # the feeder is woken, not left to its idle tick
    statements.clear()
    assert BatchLifecycle(services.db, services.queue, services.events, chunk=8).any_active() is True
    assert statements == [("SELECT", True)]
