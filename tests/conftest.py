"""Shared fixtures: real Postgres and Redis for every test that needs a store.

The machine's own servers (127.0.0.1:5432, :6379) are used when they answer, else the
embedded ones from the wheels are started. Each session gets a fresh database (migrated
with Alembic) and its own Redis database number, flushed at start.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from app.api import create_app
from app.container import Services, build_services
from app.settings import Settings
from tests.helpers import PG_URL, REDIS_DB, REDIS_URL, ROOT, Stores, make_settings
from tests.pgbouncer import VIA_PGBOUNCER, start_pgbouncer
from tests.s3 import MotoServer, start_moto


def _pg_reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.Error:
        return False


def _redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


TIERS = ("unit", "api", "integration", "faults", "fleet")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, the folder it lives in (`pytest -m unit`)."""
    for item in items:
        tier = Path(str(item.path)).relative_to(ROOT / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(scope="session")
def stores() -> Iterator[Stores]:
    from app.cli.embedded import free_port, pg_start, redis_start
    from app.cli.stack import run_migrations

    started = []
    tmp = Path(tempfile.mkdtemp(prefix="llmq-test-stores-"))
    tmp.chmod(0o755)
    if _pg_reachable(PG_URL):
        admin_url = PG_URL
    else:
        pg = pg_start(tmp / "pg", free_port(55440), "postgres")
        started.append(pg)
        admin_url = pg.url
    if _redis_reachable(REDIS_URL):
        redis_base = REDIS_URL
    else:
        rd = redis_start(tmp / "redis", free_port(56390))
        started.append(rd)
        redis_base = rd.url.rsplit("/", 1)[0]

    dbname = f"llmq_test_{secrets.token_hex(4)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    database_url = admin_url.rsplit("/", 1)[0] + f"/{dbname}"
    run_migrations(database_url)
    redis_url = f"{redis_base}/{REDIS_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    bouncer = start_pgbouncer(admin_url) if VIA_PGBOUNCER else None
    try:
        if bouncer is None:
            yield Stores(database_url, redis_url)
        else:
            yield Stores(bouncer.url(database_url), redis_url, direct_url=database_url)
    finally:
        if bouncer is not None:
            bouncer.stop()  # its server connections first, or the database cannot be dropped
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def settings(stores: Stores) -> Settings:
    return make_settings(stores)


@pytest.fixture(scope="session")
def services(settings: Settings) -> Iterator[Services]:
    svc = build_services(settings)
    yield svc
    svc.close()


@pytest.fixture(scope="session")
def app(services: Services) -> Flask:
    return create_app(services=services)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture(scope="session")
def tenant_keys(services: Services) -> dict[str, str]:
    """Two tenants, one key each."""
    suffix = secrets.token_hex(3)
    return {
        "a": services.keys.create_key(f"tenant-a-{suffix}"),
        "b": services.keys.create_key(f"tenant-b-{suffix}"),
    }


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A real S3 API server (moto's server mode) on a free port, for the session."""
    server = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()
