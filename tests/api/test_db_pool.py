"""The pool keeps the connections a burst opened past it (app/db.py KeptOverflowPool): a
second burst opens none, an idle one closes them, and the process's total holds. A process
opens its pool's connections ahead (`Database.open_pool`), up to the pool's size, never
waiting for one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy
from sqlalchemy import text

from app.connections import PoolSize
from app.db import Database, KeptOverflowPool
from tests.helpers import Stores


def burst(db: Database, width: int) -> None:
    """`width` transactions at once, each holding its connection until all have one."""
    ready = threading.Barrier(width)

    def one() -> None:
        with db.session() as s:
            s.execute(text("SELECT 1"))
            ready.wait(timeout=10)

    threads = [threading.Thread(target=one) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture
def db(stores: Stores) -> Iterator[Database]:
    db = Database.from_url(stores.database_url, PoolSize(pool=2, overflow=3))
    yield db
    db.dispose()


def test_a_second_burst_opens_no_connection(db: Database) -> None:
    opened: list[object] = []
    sqlalchemy.event.listen(db.engine, "connect", lambda *_: opened.append(1))
    pool = db.engine.pool
    assert isinstance(pool, KeptOverflowPool)
    burst(db, 5)
    assert len(opened) == 5
    assert pool.kept() == 3 and pool.checkedout() == 0
    burst(db, 5)
    burst(db, 4)
    assert len(opened) == 5


def test_kept_connections_close_once_idle(db: Database) -> None:
    closed: list[object] = []
    sqlalchemy.event.listen(db.engine.pool, "close", lambda *_: closed.append(1))
    pool = db.engine.pool
    assert isinstance(pool, KeptOverflowPool)
    pool.overflow_idle_seconds = 0.2
    burst(db, 5)
    assert pool.kept() == 3 and not closed
    time.sleep(0.3)
    with db.session() as s:  # any checkout looks
        s.execute(text("SELECT 1"))
    assert pool.kept() == 0 and len(closed) == 3
    # They count as closed: a new burst may open them again, and no more.
    burst(db, 5)
    assert pool.kept() == 3


def test_the_process_total_holds_with_connections_kept(stores: Stores) -> None:
    db = Database.from_url(stores.database_url, PoolSize(pool=1, overflow=1), pool_timeout=0.2)
    try:
        burst(db, 2)
        assert db.engine.pool.kept() == 1  # type: ignore[attr-defined]
        with db.engine.connect(), db.engine.connect(), pytest.raises(sqlalchemy.exc.TimeoutError):
            db.engine.connect()
    finally:
        db.dispose()


def test_a_waiter_gets_the_connection_returned(stores: Stores) -> None:
    db = Database.from_url(stores.database_url, PoolSize(pool=1, overflow=1), pool_timeout=5)
    try:
        first, second = db.engine.connect(), db.engine.connect()
        got: list[float] = []

        def wait() -> None:
            start = time.monotonic()
            with db.engine.connect():
                got.append(time.monotonic() - start)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        second.close()  # back to an empty queue: the waiter's
        waiter.join(timeout=5)
        assert got and got[0] < 2
        first.close()
    finally:
        db.dispose()


def test_the_pool_opens_ahead_up_to_its_size(db: Database) -> None:
    opened: list[object] = []
    sqlalchemy.event.listen(db.engine, "connect", lambda *_: opened.append(1))
    assert db.open_pool() == 2
    assert len(opened) == 2 and db.engine.pool.checkedin() == 2
    assert db.open_pool() == 0
    burst(db, 2)  # the first burst finds them
    assert len(opened) == 2


def test_opening_ahead_counts_what_others_hold_and_never_waits(stores: Stores) -> None:
    db = Database.from_url(stores.database_url, PoolSize(pool=2, overflow=0), pool_timeout=30)
    try:
        held = db.engine.raw_connection()
        started = time.monotonic()
        assert db.open_pool() == 1
        assert time.monotonic() - started < 5  # a wait for `held` would take the pool timeout
        held.close()
        assert db.engine.pool.checkedin() == 2
    finally:
        db.dispose()


def test_a_database_out_of_reach_is_left_to_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    db = Database.from_url("postgresql://postgres@127.0.0.1:1/none", PoolSize(pool=2, overflow=0))
    try:
        with caplog.at_level("WARNING", logger="llmq.db"):
            assert db.open_pool() == 0
        assert "not opened ahead" in caplog.text
        assert db.engine.pool.checkedin() == 0
    finally:
        db.dispose()


def test_the_connection_returned_last_is_taken_first(db: Database) -> None:
    """At low concurrency the same connection serves one request after another (its
    server's caches and prepared statements warm), not each of the pool's in turn."""
    assert db.open_pool() == 2

    def backend() -> int:
        with db.session() as s:
            return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())

    seen = {backend() for _ in range(6)}
    assert len(seen) == 1


def keepalive_options(db: Database) -> tuple[int, int, int, int]:
    """The pooled connection's socket (TCP, as the tests reach Postgres): SO_KEEPALIVE,
    TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT. Without settings, libpq leaves the kernel's
    (1, 7200, 75, 9)."""
    raw = db.engine.raw_connection()
    try:
        sock = socket.fromfd(raw.driver_connection.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        try:
            return (
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            )
        finally:
            sock.close()
    finally:
        raw.close()


def test_connections_probe_their_peer_when_idle(db: Database) -> None:
    """An idle pooled connection keeps its flow open through load balancers and finds a
    peer gone without a word within minutes (TCP keepalives), not the kernel's two hours."""
    assert keepalive_options(db) == (1, 60, 10, 6)


def test_the_urls_own_keepalive_settings_win(stores: Stores) -> None:
    url = stores.database_url + ("&" if "?" in stores.database_url else "?") + "keepalives_idle=30"
    db = Database.from_url(url, PoolSize(pool=1, overflow=0))
    try:
        assert keepalive_options(db) == (1, 30, 10, 6)
    finally:
        db.dispose()
