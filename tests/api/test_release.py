"""The release step (`llmq migrate`: the Procfile's `release`, compose's `migrate` service)
on a fresh database: run twice with LLMQ_BOOTSTRAP_API_KEY, the key authenticates against
the API; without the variable no key is made."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

from app.api import create_app
from app.container import build_services
from tests.helpers import ROOT, Stores, auth, make_settings


@pytest.fixture
def empty_database(stores: Stores) -> Iterator[str]:
    base, _, _ = stores.database_url.rpartition("/")
    name = f"llmq_release_{secrets.token_hex(4)}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _release(database_url: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update({"LLMQ_DATABASE_URL": database_url, "LLMQ_DATA_DIR": str(ROOT / ".no-llmq-up-here"), **extra})
    done = subprocess.run(
        [sys.executable, "-m", "app.cli.main", "migrate"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def _key_count(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM api_keys").fetchone()
    assert row is not None
    return int(row[0])


def test_release_twice_registers_the_bootstrap_key_once(stores: Stores, empty_database: str) -> None:
    key = f"boot-{secrets.token_urlsafe(16)}"
    first = _release(empty_database, LLMQ_BOOTSTRAP_API_KEY=key)
    second = _release(empty_database, LLMQ_BOOTSTRAP_API_KEY=key)
    for done in (first, second):
        assert "registered for tenant 'default'" in done.stdout
        assert key not in done.stdout + done.stderr
    assert _key_count(empty_database) == 1

    services = build_services(make_settings(stores).model_copy(update={"database_url": empty_database}))
    try:
        client = create_app(services=services).test_client()
        assert client.get("/v1/batches", headers=auth(key)).status_code == 200
        assert client.get("/v1/batches", headers=auth(key + "x")).status_code == 401
    finally:
        services.close()


def test_release_without_the_variable_makes_no_key(empty_database: str) -> None:
    done = _release(empty_database)
    assert "database is at the latest revision" in done.stdout
    assert "registered" not in done.stdout
    assert _key_count(empty_database) == 0
