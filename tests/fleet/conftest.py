"""The fleet tier: one honcho formation per module (tests/fleet/formation.py), its logs
kept after a failure for the post-mortem."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.formation import Formation
from tests.helpers import Stores

# Simulated GPU workers: a decode step costs a fixed part plus a part per running sequence,
# so a 5,000-line batch takes tens of seconds on two workers, long enough to kill and add a
# worker half way, while the service itself (API, feeder, Postgres) has CPU to spare.
ENGINE = {
    "LLMQ_ENGINE": "simulated",
    "LLMQ_MAX_NUM_SEQS": "16",
    "LLMQ_SIM_STEP_MS": "50",
    "LLMQ_SIM_STEP_MS_PER_SEQ": "1",
}


@pytest.fixture(scope="module")
def fleet(stores: Stores, request: pytest.FixtureRequest) -> Iterator[Formation]:
    # Not pytest's tmp_path: its retention would delete the logs a failure needs while
    # other sessions run; they are kept when a test failed, else removed.
    root = Path(tempfile.mkdtemp(prefix="llmq-fleet-"))
    failed_before = request.session.testsfailed
    formation = Formation.prepare(stores, root, ENGINE)
    try:
        formation.release()
        formation.create_key()
        formation.start()
        yield formation
    finally:
        formation.cleanup()
        formation.drop_database()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"fleet logs kept in {root}")
