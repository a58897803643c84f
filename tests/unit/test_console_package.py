"""The web console's files ship in the wheel (package data), so an installed llmq serves
them; built from a copy of the sources, offline, with the environment's own setuptools."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from app.api.console import ASSETS
from tests.helpers import ROOT


def test_the_wheel_holds_the_console(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("app", "worker"):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "-q"]
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *offline, str(src), "-w", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("llmq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ASSETS:
        assert f"app/console/{asset}" in names, asset
        shipped = zipfile.ZipFile(wheel).read(f"app/console/{asset}")
        assert shipped == (ROOT / "app" / "console" / asset).read_bytes()
