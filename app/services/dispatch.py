"""How many batch lines the feeder keeps out per model, and how many go in one message:
dispatch follows the capacity the model's live workers registered.

    window = ceil(headroom x sum of the live workers' capacities)    (capped by the ceiling)
           = cold_window                                             with no live worker
    chunk  = min(chunk setting, smallest live worker's capacity // 4, window), at least 1
           = min(chunk setting, cold_window // 4)                    with no live worker

A worker's capacity is the jobs it runs at once (`LLMQ_MAX_INFLIGHT`, 2 x max_num_seqs by
default), so `headroom` above 1 leaves each worker its next lines already in hand (in
Redis or in a task thread waiting for a slot) when a chunk finishes: no engine slot waits
for the feeder's next tick. Every worker added adds its capacity to the window, so batch
throughput grows with the fleet; a worker that goes takes its share out within the
feeder's capacity cache (2 s). A model with no live worker still gets `cold_window` lines
sent (scale from zero: a worker that starts finds them at once), never the whole batch.

Chunks stay at most a quarter of the smallest worker's capacity: a worker that takes a
message holds its lines until it has room for them, and the broker hands messages to the
workers in turn, so small chunks spread one batch over all of a model's workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Each worker's capacity is split over at least this many messages.
CHUNKS_PER_WORKER = 4


@dataclass(frozen=True)
class DispatchPlan:
    window: int  # lines that may be out (sent and not finished) for the model
    chunk: int  # lines per broker message


def dispatch_plan(
    capacities: Sequence[int],
    *,
    headroom: float,
    chunk: int,
    cold_window: int,
    ceiling: int | None = None,
) -> DispatchPlan:
    """The plan for one model whose live workers have `capacities` (jobs at once, each)."""
    live = [c for c in capacities if c > 0]
    if live:
        window = math.ceil(headroom * sum(live))
        per_message = min(chunk, min(live) // CHUNKS_PER_WORKER)
    else:
        window = cold_window
        per_message = min(chunk, cold_window // CHUNKS_PER_WORKER)
    if ceiling is not None:
        window = min(window, ceiling)
    return DispatchPlan(window=max(1, window), chunk=max(1, min(per_message, window)))
