"""docker-compose.yml, checked offline (Docker cannot run here): valid by the Compose
Specification's JSON schema (vendored, see tests/unit/data/README.md), and the fleet issue 11
asks for: restarts, a worker healthcheck, `ipc: host`, a model cache, one GPU per worker,
Postgres 18, the release step, and no public port for /metrics or /readyz."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.cli.main import build_parser
from app.connections import POSTGRES_RESERVED_CONNECTIONS, Fleet
from app.settings import Settings
from tests.helpers import ROOT

DATA = Path(__file__).parent / "data"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return services


def _workers() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _services().items() if s.get("command") == ["llmq", "worker"]}


def _validator() -> jsonschema.Draft7Validator:
    # The schema says draft-07 (its `$schema` lacks the trailing `#` jsonschema looks up).
    schema = json.loads((DATA / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_the_compose_file_validates_against_the_specification() -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(_compose())]
    assert errors == []


def test_the_schema_check_is_not_a_formality() -> None:
    """A misspelled key, or a wrong type, is caught by the same validator."""
    doc = _compose()
    doc["services"]["api"]["healthchek"] = doc["services"]["api"].pop("healthcheck")
    assert list(_validator().iter_errors(doc))
    doc = _compose()
    doc["services"]["api"]["ports"] = 8000
    assert list(_validator().iter_errors(doc))


def test_long_running_services_restart_and_the_release_step_does_not() -> None:
    for name, service in _services().items():
        expected = "no" if name == "migrate" else "unless-stopped"
        assert service.get("restart") == expected, name


def test_two_workers_on_two_gpus_serving_two_models() -> None:
    workers = _workers()
    assert len(workers) >= 2
    device_ids: list[str] = []
    for name, worker in workers.items():
        (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "count" not in device, f"{name}: a count would land every worker on the same GPUs"
        assert len(device["device_ids"]) == 1, name
        device_ids += device["device_ids"]
    assert len(set(device_ids)) == len(device_ids), f"two workers share a GPU: {device_ids}"
    served = {w["environment"]["LLMQ_SERVED_MODEL_NAME"] for w in workers.values()}
    assert len(served) >= 2
    # The API serves every model a worker serves, even while that worker is down.
    declared = _services()["api"]["environment"]["LLMQ_MODELS"].split(",")
    assert set(declared) == served


@pytest.mark.parametrize("name", sorted(_workers()))
def test_each_worker_is_supervised_the_way_vllm_needs(name: str) -> None:
    worker = _workers()[name]
    assert worker["healthcheck"]["test"] == ["CMD", "llmq", "worker", "health"]
    assert worker["ipc"] == "host"
    assert "models:/cache" in worker["volumes"]
    assert "HF_TOKEN" in worker["environment"]
    assert worker["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert worker["build"]["dockerfile"] == "docker/worker.Dockerfile"


def test_llmq_services_read_the_env_file_and_the_example_names_every_variable() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    example = (ROOT / ".env.example").read_text()
    defined = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", example, flags=re.MULTILINE))
    interpolated = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    assert interpolated <= defined, interpolated - defined
    for name, service in _services().items():
        if str(service.get("image", "")).startswith("llmq-"):
            assert service["env_file"] == [{"path": ".env", "required": True}], name


def test_postgres_is_18_with_max_connections_set_explicitly() -> None:
    postgres = _services()["postgres"]
    repo, _, tag = postgres["image"].partition(":")
    assert repo == "postgres" and tag.split(".")[0].split("-")[0] == "18"
    limit = next(
        int(arg.split("=", 1)[1]) for arg in postgres["command"] if arg.startswith("max_connections=")
    )
    # The compose fleet (one API of LLMQ_API_WORKERS processes, the workers shown and the
    # commented third) fits under it by the README's formula, with room for one more GPU.
    needed = Fleet(api_replicas=1, workers=len(_workers()) + 2).connections(Settings())
    assert needed + POSTGRES_RESERVED_CONNECTIONS <= limit, (needed, limit)
    # Postgres 18's image keeps PGDATA under /var/lib/postgresql/18/docker.
    assert "pgdata:/var/lib/postgresql" in postgres["volumes"]


def _published(service: dict[str, Any]) -> list[str]:
    return [str(p) for p in service.get("ports", [])]


def test_only_the_proxy_publishes_a_public_port_and_it_hides_the_ops_endpoints() -> None:
    for name, service in _services().items():
        for port in _published(service):
            if name != "proxy":
                assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    proxy = _services()["proxy"]
    (mount,) = proxy["volumes"]
    conf = (ROOT / mount.split(":")[0]).read_text()
    for path in ("/metrics", "/readyz"):
        assert re.search(rf"location = {path}\s*\{{\s*return 404;\s*\}}", conf), path
    assert "proxy_buffering off;" in conf  # server-sent events go out as they come
    assert _services()["api"]["environment"]["LLMQ_TRUSTED_PROXY_HOPS"] == "1"


def test_the_release_step_registers_the_bootstrap_key_before_anything_serves() -> None:
    services = _services()
    migrate = services["migrate"]
    assert migrate["command"] == ["llmq", "migrate"]
    assert "LLMQ_BOOTSTRAP_API_KEY" in migrate["environment"]
    assert services["api"]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    procfile = dict(
        line.split(": ", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line.strip()
    )
    assert procfile["release"] == "llmq migrate"


def test_every_command_the_fleet_runs_is_one_llmq_has() -> None:
    parser = build_parser()
    commands = [s["command"] for s in _services().values() if s.get("command", [None])[0] == "llmq"]
    commands += [w["healthcheck"]["test"][1:] for w in _workers().values()]
    procfile = (ROOT / "Procfile").read_text().splitlines()
    commands += [line.split(": ", 1)[1].replace("$PORT", "8000").split() for line in procfile if line.strip()]
    for command in commands:
        assert command[0] == "llmq"
        parser.parse_args(command[1:])  # exits (SystemExit) on an unknown command or flag


def test_every_build_names_a_dockerfile_that_exists() -> None:
    for name, service in _services().items():
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
