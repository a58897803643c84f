"""A batch's completion window: 1 hour to 7 days, in minutes, hours or days."""

from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.services.batches import window_seconds


@pytest.mark.parametrize(
    ("window", "seconds"),
    [
        ("1h", 3600),
        ("60m", 3600),
        ("90m", 5400),
        ("24h", 86400),
        ("2d", 172800),
        ("7d", 604800),
        ("168h", 604800),
    ],
)
def test_windows_from_an_hour_to_a_week_are_accepted(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize(
    "window", ["30m", "59m", "8d", "169h", "0h", "1w", "24 h", "", "soon", "01h", "9999999d"]
)
def test_other_windows_are_refused_naming_the_range(window: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        window_seconds(window)
    assert err.value.param == "completion_window"
    assert "from 1h to 7d" in str(err.value)
