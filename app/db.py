"""Database engine and session scope."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """Use the psycopg 3 driver whatever scheme the operator wrote."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def create_db_engine(url: str, *, pool_size: int = 10, pool_timeout: float = 30.0) -> Engine:
    # No pre-ping: it doubles the round trips of every short transaction. A connection
    # that died with a restart fails its statement, SQLAlchemy invalidates the pool, and
    # callers retry (see worker.runner.JobRunner._persist).
    # hide_parameters: a database error's text would otherwise carry the bound values
    # (a job's request with its prompt, a result, a key's prefix) into whatever logs it.
    return create_engine(
        normalize_url(url),
        hide_parameters=True,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=pool_timeout,
        pool_recycle=1800,
    )


class Database:
    """Owns the engine and hands out sessions that commit once at the end of a scope."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 10, pool_timeout: float = 30.0) -> Database:
        return cls(create_db_engine(url, pool_size=pool_size, pool_timeout=pool_timeout))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: commits when the block ends, rolls back when it raises."""
        with self._sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
