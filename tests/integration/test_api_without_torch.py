"""An API process never imports torch (app/gunicorn_conf.py, `post_fork`): under the real
server, with a model whose tokenizer it reads and whose context it checks, neither gunicorn
worker maps libtorch once its tokenizer is loaded, and a prompt over the context is still a
400 counted by that tokenizer. Starts no worker and no engine (the model's worker is a
registry entry)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.container import Services
from app.services.health import register_worker, unregister_worker
from tests.helpers import ApiProcess, Stores, stack_env

pytestmark = pytest.mark.api_process

MODEL = "tiny-no-torch"


def test_api_processes_count_prompts_without_torch(
    stores: Stores, tiny_model: Path, logs_dir: Path, services: Services
) -> None:
    entry = {"name": "w-no-torch", "model": MODEL, "tokenizer": str(tiny_model), "max_model_len": 64}
    register_worker(services.redis, "w-no-torch", {**entry, "capacity": 4, "consuming": True}, 120)
    log = logs_dir / "api-without-torch.log"
    api = ApiProcess(stack_env(stores, Path("api-only"), "api-only"), log)
    try:
        workers = psutil.Process(api.proc.pid).children()
        assert len(workers) == 2
        deadline = time.monotonic() + 120
        while log.read_text(errors="replace").count("tokenizer loaded") < len(workers):
            assert time.monotonic() < deadline, api.warnings()
            time.sleep(0.2)
        for worker in workers:
            mapped = Path(f"/proc/{worker.pid}/maps").read_text()
            assert "libtorch" not in mapped and "libmkl" not in mapped, f"worker {worker.pid} imported torch"
        key = services.keys.create_key("t-no-torch")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 2}
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{api.url}/v2/jobs", json=body, headers=auth, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        api.stop()
        unregister_worker(services.redis, "w-no-torch")
