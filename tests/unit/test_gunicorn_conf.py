"""gunicorn's hooks (app/gunicorn_conf.py). The metrics folder: an operator's folder is
wiped of an earlier run's files at start; without one a temporary folder is made, set for
the workers to inherit, and removed on exit. The accept board: a slot reserved for each
worker forked, taken by it, freed when it exits."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import gunicorn_conf

SERVER = SimpleNamespace(cfg=SimpleNamespace(workers=2))


def test_an_operators_folder_is_wiped_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "counter_123.db").write_bytes(b"old")
    (tmp_path / "keep.txt").write_text("not ours")
    monkeypatch.setenv(gunicorn_conf.ENV, str(tmp_path))
    gunicorn_conf.on_starting(SERVER)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_without_a_folder_one_is_made_for_the_workers_and_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gunicorn_conf.ENV, raising=False)
    monkeypatch.setattr(gunicorn_conf, "_made", [])
    gunicorn_conf.on_starting(SERVER)
    made = Path(os.environ[gunicorn_conf.ENV])
    assert made.is_dir()
    gunicorn_conf.on_exit(None)
    assert not made.exists()


def test_each_forked_worker_gets_a_slot_of_its_own_until_it_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gunicorn_conf.ENV, raising=False)
    monkeypatch.setattr(gunicorn_conf, "_made", [])
    gunicorn_conf.on_starting(SERVER)
    first, second = SimpleNamespace(pid=101), SimpleNamespace(pid=102)
    gunicorn_conf.pre_fork(SERVER, first)
    gunicorn_conf.pre_fork(SERVER, second)
    assert {first.llmq_slot, second.llmq_slot} == {0, 1}
    gunicorn_conf.child_exit(SERVER, first)
    replacement = SimpleNamespace(pid=103)
    gunicorn_conf.pre_fork(SERVER, replacement)
    assert replacement.llmq_slot == first.llmq_slot  # the exited worker's slot, not a new one
    gunicorn_conf.on_exit(SERVER)
