"""The unit tier runs with no Postgres or Redis reachable."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_servers(request: pytest.FixtureRequest) -> None:
    if "stores" in request.fixturenames:
        pytest.fail("a unit test asked for Postgres or Redis; it belongs in tests/api")
