"""Migrations: upgrade on an empty database, models match (`alembic check`), downgrade works."""

from __future__ import annotations

import secrets

import psycopg
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
