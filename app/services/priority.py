"""Request `priority`: lower runs earlier; each tenant may only ask within its band.

A tenant's band [priority_min, priority_max] is set by an operator (`llmq tenants set`);
the default band is 0..100, so a client can lower its own priority but never raise it above
the default. Bands themselves lie within PRIORITY_FLOOR..PRIORITY_CEILING, the documented
range, so no value outside it reaches the broker or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import InvalidRequest

PRIORITY_FLOOR = -1000
PRIORITY_CEILING = 1000
DEFAULT_MIN = 0
DEFAULT_MAX = 100


@dataclass(frozen=True)
class PriorityBand:
    low: int = DEFAULT_MIN
    high: int = DEFAULT_MAX

    def __post_init__(self) -> None:
        if not PRIORITY_FLOOR <= self.low <= self.high <= PRIORITY_CEILING:
            raise ValueError(
                f"a priority band must satisfy {PRIORITY_FLOOR} <= min <= max <= {PRIORITY_CEILING}; "
                f"got {self.low}..{self.high}"
            )

    @property
    def default(self) -> int:
        """What an unset `priority` means: 0, or the band's nearest end when 0 is outside it
        (an operator who demotes a tenant demotes its defaults too)."""
        return min(max(0, self.low), self.high)

    def resolve(self, requested: int | None, *, where: str = "") -> int:
        """The priority a request runs at. Raises InvalidRequest (param `priority`) for a
        value outside the band."""
        if requested is None:
            return self.default
        if not self.low <= requested <= self.high:
            raise InvalidRequest(
                f"{where}priority {requested} is outside this tenant's allowed band "
                f"{self.low}..{self.high} (lower runs earlier)",
                param="priority",
                code="priority_out_of_band",
            )
        return requested


def clamp(priority: int) -> int:
    """`priority` within the documented range."""
    return min(max(priority, PRIORITY_FLOOR), PRIORITY_CEILING)
