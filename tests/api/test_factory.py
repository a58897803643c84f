"""`create_app` takes settings or services, never both: settings beside services would be
ignored by everything the services hold (the limiter, the sync wait), so a fixture that
passed both would test something other than what it says."""

from __future__ import annotations

import pytest

from app.api import create_app
from app.container import Services
from app.settings import Settings


def test_settings_beside_services_is_refused(settings: Settings, services: Services) -> None:
    other = settings.model_copy(update={"rate_limit_per_minute": 0})
    with pytest.raises(TypeError, match="not both"):
        create_app(other, services=services)


def test_services_bring_their_own_settings(services: Services) -> None:
    app = create_app(services=services)
    assert app.config["MAX_CONTENT_LENGTH"] == services.settings.max_body_bytes
    assert app.extensions["llmq"] is services
