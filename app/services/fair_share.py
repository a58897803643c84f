"""Which tenant's batch lines the feeder sends next.

Rule (deficit round-robin, equal weights unless given): the room the feeder has is shared
among the tenants with lines waiting. Tenants are visited in rounds, in id order starting
after the tenant served last (so across calls nobody always goes first). Each visit a
tenant earns `weight` lines of credit and sends as many whole lines as its credit and its
waiting lines allow, keeping the fraction for its next visit; a tenant with nothing left
waiting loses its credit. Rounds repeat until the room is spent or nothing waits.

So one tenant's 50,000-line batch and another's one-line batch each get a line in the
first round; age and size of a batch do not matter across tenants, and a tenant with
weight 2 gets twice the lines of one with weight 1 while both have lines waiting. Weights
are set per tenant by an operator (`llmq tenants set --weight`, default 1) and passed in
with each call, so a change applies at the feeder's next tick. Within a tenant, lines go
in priority order, then earliest deadline first (the batch's `created_at` + completion
window), then batch and line order: the feeder's query, not this module. Deadlines do not
cross tenants: a tenant cannot buy a larger share by asking for short windows.
"""

from __future__ import annotations

from collections.abc import Mapping


class FairShare:
    def __init__(self, weights: Mapping[str, float] | None = None, *, default_weight: float = 1.0) -> None:
        if default_weight <= 0 or any(w <= 0 for w in (weights or {}).values()):
            raise ValueError("weights must be positive")
        self._weights = dict(weights or {})
        self._default = default_weight
        self._credit: dict[str, float] = {}
        self._last: str | None = None

    def pick(
        self, waiting: Mapping[str, int], room: int, weights: Mapping[str, float] | None = None
    ) -> list[str]:
        """One tenant id per line to send, in the order the lines should go (interleaved
        round by round), at most `room` of them and never more than a tenant has waiting.
        `weights` (per call) override the ones given at construction."""
        weight = {**self._weights, **{t: w for t, w in (weights or {}).items() if w > 0}}
        left = {t: n for t, n in waiting.items() if n > 0}
        self._credit = {t: c for t, c in self._credit.items() if t in left}
        order = sorted(left)
        if self._last is not None:
            after = [t for t in order if t > self._last]
            order = after + [t for t in order if t <= self._last]
        picks: list[str] = []
        while room > 0 and left:
            for tenant in order:
                if tenant not in left:
                    continue
                credit = self._credit.get(tenant, 0.0) + weight.get(tenant, self._default)
                while credit >= 1 and left[tenant] > 0 and room > 0:
                    picks.append(tenant)
                    credit -= 1
                    left[tenant] -= 1
                    room -= 1
                    self._last = tenant
                if left[tenant] == 0:
                    del left[tenant]
                    self._credit.pop(tenant, None)
                else:
                    self._credit[tenant] = credit
                if room == 0:
                    break
        return picks
