"""`create_app` takes settings or services, never both: settings beside services would be
ignored by everything the services hold (the limiter, the sync wait), so a fixture that
passed both would test something other than what it says."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from app.api import create_app, serve_app
from app.container import Services
from app.settings import Settings
from tests.helpers import ROOT, TINY_DIR


def test_settings_beside_services_is_refused(settings: Settings, services: Services) -> None:
    other = settings.model_copy(update={"rate_limit_per_minute": 0})
    with pytest.raises(TypeError, match="not both"):
        create_app(other, services=services)


def test_services_bring_their_own_settings(services: Services) -> None:
    app = create_app(services=services)
    assert app.config["MAX_CONTENT_LENGTH"] == services.settings.max_body_bytes
    assert app.extensions["llmq"] is services


def test_the_served_app_warms_its_tokenizers_and_connections_before_any_request(settings: Settings) -> None:
    """The app as gunicorn serves it loads the known models' tokenizers in the background,
    so a process's first requests do not wait seconds for the load."""
    if not (TINY_DIR / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "app.cli.main", "model", "build-tiny", str(TINY_DIR)], check=True, cwd=ROOT
        )
    served = settings.model_copy(update={"model": str(TINY_DIR), "served_model_name": "tiny-warm"})
    app = serve_app(served)
    services = app.extensions["llmq"]
    try:
        assert services.tokenizers is not None
        deadline = time.monotonic() + 120
        while str(TINY_DIR) not in services.tokenizers.loaded() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert services.tokenizers.loaded() == [str(TINY_DIR)]
        # And its Postgres connections, up to the pool's size, before any request.
        pool = services.db.engine.pool
        while pool.checkedin() < pool.size() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.checkedin() == pool.size() == settings.db_pool_size
    finally:
        services.close()
