"""gunicorn's hooks for the metrics folder (app/gunicorn_conf.py): an operator's folder is
wiped of an earlier run's files at start; without one a temporary folder is made, set for
the workers to inherit, and removed on exit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import gunicorn_conf


def test_an_operators_folder_is_wiped_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "counter_123.db").write_bytes(b"old")
    (tmp_path / "keep.txt").write_text("not ours")
    monkeypatch.setenv(gunicorn_conf.ENV, str(tmp_path))
    gunicorn_conf.on_starting(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_without_a_folder_one_is_made_for_the_workers_and_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gunicorn_conf.ENV, raising=False)
    monkeypatch.setattr(gunicorn_conf, "_made", [])
    gunicorn_conf.on_starting(None)
    made = Path(os.environ[gunicorn_conf.ENV])
    assert made.is_dir()
    gunicorn_conf.on_exit(None)
    assert not made.exists()
