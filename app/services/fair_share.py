"""Which tenant's batch lines the feeder sends next.

Rule (weighted fair share of the lines in flight): the room the feeder has is given out
one line at a time, each to the tenant with lines waiting whose lines out (sent or
running, counted by the feeder) plus lines picked so far, divided by its weight, is the
least. Ties go in tenant id order starting after the tenant served last, so across calls
nobody always goes first. It is deficit round-robin whose deficit is the tenant's share of
the engine's slots rather than of the room of one tick: a tenant whose lines are all
running keeps no credit, and a tenant that arrives while another holds every slot takes
each slot that frees until both hold their share.

So one tenant's 50,000-line batch and another's one-line batch each get a line in the
first round; age and size of a batch do not matter across tenants, and a tenant with
weight 2 holds twice the slots of one with weight 1 while both have lines waiting. Weights
are set per tenant by an operator (`llmq tenants set --weight`, default 1) and passed in
with each call, so a change applies at the feeder's next tick. Within a tenant, lines go
in priority order, then earliest deadline first (the batch's `created_at` + completion
window), then batch and line order: the feeder's query, not this module. Deadlines do not
cross tenants: a tenant cannot buy a larger share by asking for short windows.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


class FairShare:
    def __init__(self, weights: Mapping[str, float] | None = None, *, default_weight: float = 1.0) -> None:
        if default_weight <= 0 or any(w <= 0 for w in (weights or {}).values()):
            raise ValueError("weights must be positive")
        self._weights = dict(weights or {})
        self._default = default_weight
        self._last: str | None = None

    def pick(
        self,
        waiting: Mapping[str, int],
        room: int,
        weights: Mapping[str, float] | None = None,
        out: Mapping[str, int] | None = None,
    ) -> list[str]:
        """One tenant id per line to send, in the order the lines should go, at most `room`
        of them and never more than a tenant has waiting. `out` is each tenant's lines
        already sent or running; `weights` (per call) override the ones given at
        construction."""
        weight = {**self._weights, **{t: w for t, w in (weights or {}).items() if w > 0}}
        left = {t: n for t, n in waiting.items() if n > 0}
        order = sorted(left)
        if self._last is not None:
            order = [t for t in order if t > self._last] + [t for t in order if t <= self._last]
        held = {t: (out or {}).get(t, 0) for t in order}
        heap = [(held[t] / weight.get(t, self._default), rank, t) for rank, t in enumerate(order)]
        heapq.heapify(heap)
        picks: list[str] = []
        while room > 0 and heap:
            _, rank, tenant = heapq.heappop(heap)
            picks.append(tenant)
            self._last = tenant
            room -= 1
            left[tenant] -= 1
            held[tenant] += 1
            if left[tenant] > 0:
                heapq.heappush(heap, (held[tenant] / weight.get(tenant, self._default), rank, tenant))
        return picks
