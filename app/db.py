"""Database engine and session scope."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import psycopg
import sqlalchemy
from psycopg.pq import ExecStatus, TransactionStatus
from sqlalchemy import Connection, Engine, TextClause
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection, QueuePool
from sqlalchemy.util import queue as sqla_queue

from app import jsontext, tracing
from app.connections import PoolSize
from app.settings import Settings

log = logging.getLogger("llmq.db")

# A statement for `Database.at_once`: driver SQL with %(name)s placeholders, and its values.
Statement = tuple[str, Mapping[str, Any]]


def normalize_url(url: str) -> str:
    """Use the psycopg 3 driver whatever scheme the operator wrote."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


# How long a connection opened past the pool stays open unused before it is closed.
OVERFLOW_IDLE_SECONDS = 30.0


class KeptOverflowPool(QueuePool):
    """SQLAlchemy's QueuePool, except that a connection opened past the pool (its overflow)
    is not closed the moment it comes back to a full pool: it is kept, taken by the next
    checkout that finds the pool empty, and closed once it has gone `overflow_idle_seconds`
    unused (looked at on every checkout and return). The process still opens at most
    `pool_size + max_overflow` connections; under steady load it stops opening and closing
    them.

    QueuePool closes an overflow connection as soon as the pool is full again, so every
    burst wider than the pool (the API's concurrent requests, the worker's task threads
    claiming a burst of jobs) opened and closed up to `max_overflow` of them per process:
    a server process forked, logged in and ended each time. At 64 jobs of 256 tokens, 10-15
    backends started and ended within a 2.5 s run, and Postgres's CPU per job went from
    about 4 to 2.4 ms without them.

    A waiter for a connection exists only while the pool's queue is empty, and a returned
    connection is kept aside only while it is full, so none waits while one is kept."""

    def __init__(self, *args: Any, overflow_idle_seconds: float = OVERFLOW_IDLE_SECONDS, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.overflow_idle_seconds = overflow_idle_seconds
        self._kept: list[tuple[ConnectionPoolEntry, float]] = []  # oldest return first
        self._kept_lock = threading.Lock()

    def _do_get(self) -> ConnectionPoolEntry:
        self._close_idle()
        try:
            return self._pool.get(False)
        except sqla_queue.Empty:
            pass
        with self._kept_lock:
            if self._kept:
                return self._kept.pop()[0]  # the most recently used: the oldest age out
        return super()._do_get()

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        try:
            self._pool.put(record, False)
        except sqla_queue.Full:
            with self._kept_lock:
                self._kept.append((record, time.monotonic()))
        self._close_idle()

    def _close_idle(self) -> None:
        now = time.monotonic()
        with self._kept_lock:
            idle = [record for record, since in self._kept if now - since >= self.overflow_idle_seconds]
            if not idle:
                return
            self._kept = self._kept[len(idle) :]
        for record in idle:
            try:
                record.close()
            finally:
                self._dec_overflow()

    def kept(self) -> int:
        """Overflow connections open and unused."""
        with self._kept_lock:
            return len(self._kept)

    def checkedout(self) -> int:
        return int(super().checkedout()) - self.kept()

    def dispose(self) -> None:
        with self._kept_lock:
            kept, self._kept = self._kept, []
        for record, _ in kept:
            record.close()
        super().dispose()  # and the overflow count starts again from nothing

    def recreate(self) -> KeptOverflowPool:
        pool = super().recreate()
        assert isinstance(pool, KeptOverflowPool)
        pool.overflow_idle_seconds = self.overflow_idle_seconds
        return pool


def create_db_engine(
    url: str, pool: PoolSize, *, pool_timeout: float = 30.0, transaction_pooler: bool = False
) -> Engine:
    """The process's one engine, opening at most `pool.total` connections (app/connections.py).

    `transaction_pooler`: `url` is PgBouncer (or another pooler) in transaction mode, where
    consecutive transactions of one client connection may run on different server
    connections. psycopg then never prepares a statement server-side (by default it does
    after 5 executions, and the next transaction would not find it). Nothing else here
    keeps session state: locks are transaction-scoped (pg_advisory_xact_lock), COPY runs
    inside its transaction, downloads page with short queries, and no SET, LISTEN or
    temporary table is used.
    """
    # No pre-ping: it doubles the round trips of every short transaction. A connection
    # that died with a restart fails its statement, SQLAlchemy invalidates the pool, and
    # callers retry (see worker.runner.JobRunner._persist).
    # hide_parameters: a database error's text would otherwise carry the bound values
    # (a job's request with its prompt, a result, a key's prefix) into whatever logs it.
    # Looked up on the module at each call: with LLMQ_OTEL, OpenTelemetry's SQLAlchemy
    # instrumentation wraps `sqlalchemy.create_engine` after this module was imported.
    return sqlalchemy.create_engine(
        normalize_url(url),
        hide_parameters=True,
        poolclass=KeptOverflowPool,
        pool_size=pool.pool,
        max_overflow=pool.overflow,
        pool_timeout=pool_timeout,
        pool_recycle=1800,
        # The connection returned last is taken first: at low concurrency the same one or
        # two serve every request, with their server process's catalog caches and prepared
        # statements warm. Taken in turn (FIFO, SQLAlchemy's default), each of the pool's
        # connections, opened ahead, paid its first inserts and claims cold: single
        # streams' inserts took 37-143 ms now and then against 2-3 ms, and B5's p99 at one
        # stream was theirs (diagnostic runs: the worst insert of 32 streams 37-84 ms in
        # turn, 3-10 ms last-in first-out).
        pool_use_lifo=True,
        # json and jsonb values go to Postgres as compact JSON written by pydantic-core, as
        # the worker writes a result's documents, and come back parsed by it
        # (app/jsontext.py): psycopg's dumper and loader for this engine's connections (a
        # job's request at submit: 2.6 -> 0.75 µs).
        json_serializer=jsontext.compact,
        json_deserializer=jsontext.loads,
        connect_args=connect_args(url, transaction_pooler=transaction_pooler),
    )


# TCP keepalives on every connection (libpq's settings; a Unix socket ignores them). With
# last-in first-out pools, the connections past the working set at low concurrency sit
# idle until the next burst; a load balancer or NAT that drops idle flows (an AWS NLB after
# 350 s) would leave them half-open, and the first statement on one would wait on a dead
# peer. A probe after 60 s idle keeps such a flow open, and a peer that stopped answering
# (a host that went away without a FIN) is found within 60 + 6 × 10 s instead of the
# kernel's two hours.
KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 60,
    "keepalives_interval": 10,
    "keepalives_count": 6,
}


def connect_args(url: str, *, transaction_pooler: bool = False) -> dict[str, object]:
    """psycopg's connection arguments: `KEEPALIVES`, less any the URL's query sets itself
    (an operator's `?keepalives_idle=30` wins), and no server-side prepared statements
    behind a transaction pooler (`create_db_engine`). A URL of another database (the unit
    tests' SQLite) gets none of them."""
    parsed = sqlalchemy.engine.make_url(normalize_url(url))
    if parsed.get_backend_name() != "postgresql":
        return {}
    args: dict[str, object] = {k: v for k, v in KEEPALIVES.items() if k not in parsed.query}
    if transaction_pooler:
        args["prepare_threshold"] = None
    return args


class Database:
    """Owns the engine and hands out sessions that commit once at the end of a scope."""

    def __init__(
        self,
        engine: Engine,
        *,
        later_page_slots: int = 1,
        capacity: int | None = None,
        spare_wait_seconds: float = 0.0,
    ) -> None:
        """`later_page_slots`: how many connections downloads' later pages may hold at once
        (`page`). `capacity`: how many the engine's pool may open (pool and overflow), given
        where later pages should leave the last free connection to requests (the API), for
        `spare_wait_seconds` at most."""
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reads = sessionmaker(autocommit, expire_on_commit=False)
        self._later_pages = threading.BoundedSemaphore(later_page_slots)
        self._capacity = capacity
        self._spare_wait = spare_wait_seconds
        self._returned = threading.Condition()
        # `returning`'s statements (by their text), compiled once to the driver's SQL.
        self._compiled: dict[str, str] = {}
        if capacity is not None:
            sqlalchemy.event.listen(engine.pool, "checkin", self._on_checkin)

    @classmethod
    def from_url(
        cls,
        url: str,
        pool: PoolSize,
        *,
        pool_timeout: float = 30.0,
        transaction_pooler: bool = False,
        serves_requests: bool = False,
    ) -> Database:
        """`serves_requests`: an API process's, whose requests go before downloads' later
        pages (`page`)."""
        return cls(
            create_db_engine(url, pool, pool_timeout=pool_timeout, transaction_pooler=transaction_pooler),
            later_page_slots=max(1, pool.total // 2),
            capacity=pool.total if serves_requests else None,
            spare_wait_seconds=pool_timeout,
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, pool: PoolSize, *, pool_timeout: float = 30.0, serves_requests: bool = False
    ) -> Database:
        """The database at LLMQ_DATABASE_URL, behind LLMQ_DATABASE_POOLER if one is set."""
        return cls.from_url(
            settings.require_database_url(),
            pool,
            pool_timeout=pool_timeout,
            transaction_pooler=settings.database_pooler != "none",
            serves_requests=serves_requests,
        )

    def open_pool(self) -> int:
        """Open the pool's connections now, up to its size, and return how many were opened.
        The first burst after a start then finds them, instead of each of its requests
        opening one while the burst needs the cores: a Postgres server process forked and
        logged in per connection, about 3.7 ms of Postgres CPU each (27 of them in B1's first
        burst of 64 submits, where the pools were cold). Never waits for a connection: it
        stops once the pool holds its size, however many others have checked out meanwhile.
        A database out of reach is logged and left to the pool, which opens connections as
        they are needed."""
        pool = self.engine.pool
        if not isinstance(pool, QueuePool):
            return 0
        # QueuePool's overflow counts from -size: below 0, a checkout that finds no idle
        # connection opens one rather than waiting.
        before = pool.overflow()
        held: list[PoolProxiedConnection] = []
        try:
            while pool.overflow() < 0:
                held.append(self.engine.raw_connection())
        except (DBAPIError, PoolTimeout, psycopg.Error) as exc:  # raw_connection: unwrapped
            log.warning("postgres connections not opened ahead", extra={"error": str(exc).splitlines()[0]})
        finally:
            for conn in held:
                conn.close()  # back to the pool, open
        return pool.overflow() - before

    def open_pool_in_background(self) -> None:
        """`open_pool` on a thread of its own (a greenlet under gevent): a process's start
        never waits on a Postgres that does not answer."""
        threading.Thread(target=self.open_pool, name="llmq-pool-open", daemon=True).start()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: commits when the block ends, rolls back when it raises."""
        with self._sessions() as session, session.begin():
            yield session

    def at_once(self, statements: Sequence[Statement]) -> int:
        """Run `statements` in one transaction and commit it; the last one's row count.

        They reach Postgres as one query string, their values bound on this side (psycopg's
        client-side binding, each value quoted as a literal by libpq), on a connection in
        autocommit: Postgres runs a string of several statements as one transaction of its
        own, committed when the last ends and rolled back whole if one fails. Still each
        statement takes its own snapshot when the one before has ended: a lock taken by one
        holds for the reads of the next. One round trip and one wait for it, where psycopg's
        pipeline mode (BEGIN, the statements and COMMIT queued, read at one sync) waited on
        the socket once per statement: an API process's CPU for a submit's insert went from
        about 0.37 to 0.11 ms in-process, and per submit in a running stack from 2.80 to 2.39
        ms, while Postgres, which now parses and plans the string each time instead of
        running a prepared statement, took 0.15 ms more. With tracing on they go through
        SQLAlchemy one by one, so that each has its span.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's own execute would (on a broken
                connection the pool's connections are invalidated, as SQLAlchemy does).
        """
        if tracing.enabled():
            rowcount = -1
            with self.engine.begin() as traced:
                for sql, params in statements:
                    rowcount = traced.exec_driver_sql(sql, params).rowcount
            return rowcount
        with self._autocommit(*statements[-1]) as conn:
            cursor = psycopg.ClientCursor(conn)
            # Each statement bound alone (their parameter names may repeat), then sent
            # as one string without parameters: nothing in it is read as a placeholder.
            cursor.execute("; ".join(cursor.mogrify(query, values) for query, values in statements))
            rowcount = cursor.rowcount
            while cursor.nextset():
                rowcount = cursor.rowcount
            return rowcount

    def returning(self, statement: TextClause, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement that is a whole transaction by itself (a worker's claim, its
        result write, a poll's read) and return its rows, as tuples.

        As `one_statement` runs it (autocommit: no BEGIN, no COMMIT), but on the pooled
        connection's psycopg cursor, not through a Session and its Result: on this machine
        the worker's CPU for a one-row claim went from 0.32 to 0.15 ms, twice per job. The
        statement is compiled once to psycopg's placeholders; psycopg binds the values and,
        unless a transaction pooler is in front, prepares it on the server after 5 runs, as
        it does under SQLAlchemy. Its parameters and columns must be untyped (no
        `bindparams(type_=...)`, no `.columns()`): values go to psycopg as they are and rows
        come back as psycopg reads them, which is what SQLAlchemy does with an untyped
        `text()`. With tracing on it goes through `one_statement`, for its span.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's own execute would.
        """
        if tracing.enabled():
            with self.one_statement() as s:
                result = s.connection().execute(statement, params)
                return [tuple(row) for row in result] if result.returns_rows else []
        sql = self._compiled.get(statement.text)
        if sql is None:
            sql = self._compiled[statement.text] = str(statement.compile(dialect=self.engine.dialect))
        with self._autocommit(sql, params) as conn, conn.cursor() as cursor:
            cursor.execute(sql, params)
            # Whether it returned rows, from the result's status: psycopg's `description`
            # builds an object a column each time it is read (a poll's 27: 41-55 us).
            answer = cursor.pgresult
            return cursor.fetchall() if answer is not None and answer.status == ExecStatus.TUPLES_OK else []

    @contextmanager
    def _autocommit(self, sql: str, params: Mapping[str, Any]) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection's psycopg connection in autocommit, for one use; a driver
        error comes out as SQLAlchemy's (`sql` and `params` are what it names, hidden)."""
        try:
            fairy = self.engine.raw_connection()
        except psycopg.Error as exc:
            # A connection the pool could not open (Postgres down or restarting): SQLAlchemy's
            # error, as `Engine.connect` raises it, so that callers' retries see it.
            raise DBAPIError.instance(
                None,
                None,
                exc,
                psycopg.Error,
                hide_parameters=True,
                connection_invalidated=self.engine.dialect.is_disconnect(cast(Any, exc), None, None),
            ) from exc
        conn = fairy.driver_connection
        assert isinstance(conn, psycopg.Connection)
        try:
            conn.autocommit = True
            try:
                yield conn
            finally:
                if not (conn.broken or conn.closed):
                    if conn.info.transaction_status != TransactionStatus.IDLE:
                        conn.rollback()  # autocommit leaves none open; if one is, it goes
                    conn.autocommit = False
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                # As SQLAlchemy's execute does on a disconnect: this connection is dropped,
                # and every other opened before it is replaced at its next checkout (after
                # a Postgres restart they are all dead; each would fail a request first).
                self.engine.pool._invalidate(fairy, exc)
            raise DBAPIError.instance(
                sql,
                params,
                exc,
                psycopg.Error,
                hide_parameters=True,
                connection_invalidated=conn.broken or conn.closed,
            ) from exc
        finally:
            fairy.close()

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A session that only reads, on a connection in autocommit: each statement is its
        own transaction, which changes nothing a reader sees (under READ COMMITTED each
        statement of a transaction takes its own snapshot anyway), and psycopg sends no BEGIN
        and no COMMIT: a request that makes one read (a poll, a key lookup) makes one round
        trip to Postgres instead of three. Never write in it: each write would commit alone
        (one write that is a whole transaction by itself: `one_statement`)."""
        with self._reads() as session:
            yield session

    @contextmanager
    def one_statement(self) -> Iterator[Session]:
        """A session for one statement that writes and is a whole transaction by itself (a
        worker's claim, its result write): in autocommit, Postgres runs the statement as its
        own transaction, atomically, as BEGIN and COMMIT around it would, and psycopg sends
        neither: one round trip instead of three. Run exactly one statement in it."""
        with self._reads() as session:
            yield session

    @contextmanager
    def page(self, *, first: bool, on: Connection | None = None) -> Iterator[Connection]:
        """A connection for one page of a download (its own short query). Pages after the
        first share at most half of the pool, waiting their turn: dozens of downloads keep
        streaming, and the other half stays free for requests, other tenants' calls and new
        downloads' first pages among them, which must find a connection within the pool
        timeout or answer 503 (CI saw 503s when later pages took the whole pool).
        `on`: the first page's connection, already held by the request (it read the file's
        row on it), so that a download's request checks out one connection, not two; later
        pages ignore it."""
        if first and on is not None:
            yield on
            return
        if first:
            with self.engine.connect() as conn:
                yield conn
            return
        with self._later_pages:
            self._wait_for_spare_connection()
            with self.engine.connect() as conn:
                yield conn

    def _wait_for_spare_connection(self) -> None:
        """Wait until two or more of the pool's connections are free (one, for a pool of one),
        for the pool timeout at most; then the page asks the pool like any caller. A
        download's later page does not take the last free connection, nor one that a waiting
        request was about to get: while requests queue for the pool none is free, and the
        pages wait behind them (60 unread downloads at once, on a loaded machine, kept new
        requests waiting past the pool timeout while pages came and went)."""
        if self._capacity is None:
            return
        pool, spare = self.engine.pool, min(2, self._capacity)
        until = time.monotonic() + self._spare_wait
        with self._returned:
            while self._capacity - pool.checkedout() < spare:  # type: ignore[attr-defined]
                left = until - time.monotonic()
                if left <= 0:
                    return
                # Woken at each check-in. The event comes just before the connection is back
                # in the pool; under gevent the woken greenlet runs after the returning one
                # has put it back. The timeout makes sure of a look now and then.
                self._returned.wait(timeout=min(left, 0.05))

    def _on_checkin(self, *_: object) -> None:
        with self._returned:
            self._returned.notify_all()

    def dispose(self) -> None:
        self.engine.dispose()
