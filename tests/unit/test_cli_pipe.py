"""A CLI command whose reader goes away (`llmq batch status B | head -c 400`) stops quietly
with the shell's SIGPIPE status, not a BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import app.cli.main as cli

class Client:
    def get_batch(self, batch_id):
        return {"id": batch_id, "notes": ["x" * 1000] * 2000}

cli._client = lambda args: Client()
sys.exit(cli.main(["batch", "status", "batch_x"]))
"""


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte is written
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            check=False,
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr.decode(), done.stderr.decode()
    assert done.returncode == 141
