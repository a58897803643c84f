"""Hypothesis settings of the property tests that run in the suite: `LLMQ_FUZZ_EXAMPLES`
examples a test (`bash scripts/fuzz.sh` raises it), no deadline, no health check, no example
database, and the same examples on every CI run."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_settings(default_examples: int, *, scale: int = 1) -> settings:
    """`scale` times `LLMQ_FUZZ_EXAMPLES` examples (`default_examples` when unset)."""
    return settings(
        max_examples=int(os.environ.get("LLMQ_FUZZ_EXAMPLES", str(default_examples))) * scale,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=os.environ.get("CI") == "true",
        database=None,
    )
