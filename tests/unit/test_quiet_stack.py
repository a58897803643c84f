"""`llmq up` is quiet by default: a component's output goes to its file under the data dir,
and with `--verbose` to the terminal instead; a component that dies is explained from the
end of its file."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from app.cli.stack import Stack
from app.settings import Settings

pytestmark = pytest.mark.unit

SPEAK = [sys.executable, "-c", "import sys; print('to stdout'); print('to stderr', file=sys.stderr)"]


def run_child(stack: Stack) -> None:
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    stack._start("api", SPEAK, signal.SIGTERM)
    assert stack.procs["api"].wait(30) == 0


def test_a_components_output_goes_to_its_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    stack = Stack(Settings(), host="127.0.0.1", port=0, data_dir=tmp_path)
    run_child(stack)
    out, err = capfd.readouterr()
    assert "to stdout" not in out + err and "to stderr" not in out + err
    assert stack.log_files()["api"] == tmp_path.resolve() / "logs" / "api.log"
    assert stack.log_files()["api"].read_text().split() == ["to", "stdout", "to", "stderr"]
    assert stack.log_tail("api", lines=1) == "to stderr"


def test_verbose_leaves_it_on_the_terminal(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    stack = Stack(Settings(), host="127.0.0.1", port=0, data_dir=tmp_path, verbose=True)
    run_child(stack)
    out, err = capfd.readouterr()
    assert "to stdout" in out and "to stderr" in err
    assert not (tmp_path / "logs" / "api.log").exists()
    assert stack.log_tail("api") == ""
