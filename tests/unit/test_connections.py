"""The connection budget (app/connections.py): pools follow from settings, and the fleet the
README documents fits the `max_connections` it suggests."""

from __future__ import annotations

import re
import threading
import time
from importlib import metadata
from pathlib import Path
from unittest import mock

import redis.utils

from app.connections import (
    ADMIN_CONNECTIONS,
    DOCUMENTED_FLEET,
    POSTGRES_RESERVED_CONNECTIONS,
    SUGGESTED_MAX_CONNECTIONS,
    WEBHOOK_POOL,
    Fleet,
    PoolSize,
    api_pool,
    quick_redis_client,
    redis_client,
    worker_connections,
    worker_pool,
)
from app.db import KEEPALIVES, Database, connect_args, create_db_engine
from app.settings import Settings
from tests.helpers import ROOT

# Postgres's own default: what `llmq up`'s embedded Postgres and a stock server have.
POSTGRES_DEFAULT_MAX_CONNECTIONS = 100


def test_pools_follow_settings() -> None:
    s = Settings(db_pool_size=6, worker_db_pool_size=3, db_max_overflow=2, api_workers=4)
    assert (api_pool(s).pool, api_pool(s).overflow, api_pool(s).total) == (6, 2, 8)
    assert (worker_pool(s).pool, worker_pool(s).overflow, worker_pool(s).total) == (3, 2, 5)
    assert worker_connections(s) == 5 + WEBHOOK_POOL.total
    # 3 replicas of 4 gunicorn processes of 8, 5 workers of 5 + webhook delivery's, the admin reserve.
    assert Fleet(api_replicas=3, workers=5).connections(s) == 3 * 4 * 8 + 5 * (5 + 2) + ADMIN_CONNECTIONS


def test_the_engine_is_built_with_the_pool_it_is_given() -> None:
    pool = api_pool(Settings(db_pool_size=7, db_max_overflow=3))
    engine = create_db_engine("postgresql://nobody@127.0.0.1:9/none", pool)
    try:
        # size() is the kept connections; overflow() starts at -size and may reach +max_overflow.
        assert engine.pool.size() == 7  # type: ignore[attr-defined]
        assert engine.pool._max_overflow == 3  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_the_start_line_names_the_process_total() -> None:
    line = worker_pool(Settings()).describe()
    assert line == "postgres connections: up to 12 (pool 8 + overflow 4) per process"


def test_the_documented_fleet_fits_the_suggested_max_connections() -> None:
    total = DOCUMENTED_FLEET.connections(Settings())
    assert total + POSTGRES_RESERVED_CONNECTIONS < SUGGESTED_MAX_CONNECTIONS, total


def test_one_api_and_one_worker_fit_postgres_default() -> None:
    """Issue 11: one API and one worker used to take 104, over Postgres's default 100."""
    total = Fleet(api_replicas=1, workers=1).connections(Settings())
    assert total + POSTGRES_RESERVED_CONNECTIONS < POSTGRES_DEFAULT_MAX_CONNECTIONS, total


def test_the_readme_states_the_computed_figures() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Connection budget", 1)[1].split("\n## ", 1)[0]
    s = Settings()
    figures = {int(n) for n in re.findall(r"\*\*(\d+)\*\*", section)}
    assert {
        api_pool(s).total,
        worker_connections(s),
        DOCUMENTED_FLEET.connections(s),
        SUGGESTED_MAX_CONNECTIONS,
    } <= figures, figures


def test_downloads_later_pages_share_half_the_pool_and_first_pages_never_wait_for_them(
    tmp_path: Path,
) -> None:
    """Dozens of slow downloads would otherwise hold every connection with their later
    pages, and a new download's first page (or another tenant's call) would 503."""
    db = Database.from_url(f"sqlite:///{tmp_path / 'pages.db'}", PoolSize(pool=4, overflow=0))
    order: list[str] = []
    release = threading.Event()

    def later_page(name: str) -> None:
        with db.page(first=False):
            order.append(name)
            release.wait(5)

    first_two = [threading.Thread(target=later_page, args=(f"later-{i}",)) for i in range(2)]
    for t in first_two:
        t.start()
    while len(order) < 2:
        time.sleep(0.01)
    third = threading.Thread(target=later_page, args=("later-2",))
    third.start()
    time.sleep(0.2)
    assert sorted(order) == ["later-0", "later-1"]  # the third waits for a slot
    with db.page(first=True) as conn:  # a first page goes straight to the pool
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    release.set()
    for t in [*first_two, third]:
        t.join(5)
    assert sorted(order) == ["later-0", "later-1", "later-2"]
    db.dispose()


def test_connection_arguments_by_database() -> None:
    """Keepalives for Postgres (the URL's own settings win), nothing prepared behind a
    transaction pooler, and nothing libpq-only for another database."""
    assert connect_args("postgres://u@db/llmq") == KEEPALIVES
    mine = connect_args("postgresql://u@db/llmq?keepalives_idle=30&keepalives=1")
    assert mine == {"keepalives_interval": 10, "keepalives_count": 6}
    assert connect_args("postgresql://u@pgbouncer/llmq", transaction_pooler=True) == {
        **KEEPALIVES,
        "prepare_threshold": None,
    }
    assert connect_args("sqlite:///pages.db") == {}


def test_a_new_redis_connection_names_the_library_without_reading_its_metadata_again() -> None:
    """Every process's clients share the driver's name and version, found once: a burst that
    opens dozens of connections does not read the package's metadata from disk for each."""
    clients = [redis_client("redis://127.0.0.1:1/0"), quick_redis_client("redis://127.0.0.1:1/0")]
    with mock.patch.object(redis.utils, "get_lib_version", side_effect=AssertionError("metadata read")):
        connections = [c.connection_pool.make_connection() for c in clients for _ in range(3)]
    for connection in connections:
        assert connection.driver_info.formatted_name == "redis-py"
        assert connection.driver_info.lib_version == metadata.version("redis")
