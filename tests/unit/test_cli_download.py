"""`llmq batch download`: the output directory is made when missing, and one that cannot be
made is a one-line error, not a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import app.cli.main as cli


class FakeClient:
    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return {"id": batch_id, "status": "completed", "output_file_id": "file_out", "error_file_id": None}

    def download(self, file_id: str, path: Path) -> int:
        path.write_text('{"custom_id": "a"}\n')
        return 1


@pytest.fixture(autouse=True)
def fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_client", lambda args: FakeClient())


def test_a_missing_output_directory_is_made(tmp_path: Path) -> None:
    out = tmp_path / "results" / "today"
    assert cli.main(["batch", "download", "batch_x", "--output-dir", str(out)]) == 0
    assert (out / "batch_x.output.jsonl").read_text() == '{"custom_id": "a"}\n'


def test_an_output_directory_that_is_a_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    assert cli.main(["batch", "download", "batch_x", "--output-dir", str(taken)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"cannot write to {taken}: it is a file, not a directory"
