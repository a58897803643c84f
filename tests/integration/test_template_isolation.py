"""Template bombs cannot take the API from other tenants (issue 9 item 2, RELIABILITY X9).

The API runs under gunicorn with gevent workers and no worker process: a render that ran in
an API process would block every request of that process. While one tenant sends
template-like CPU bombs through every field that reaches the chat template, another
tenant's requests answer within 2 s, and a template smuggled in `chat_template_kwargs` is
a 400 naming it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ApiProcess, Stores, stack_env

pytestmark = pytest.mark.integration

MODEL = "tiny-templates"
LOOP = "{% for i in range(3000) %}{% for j in range(3000) %}{{ i * j }}{% endfor %}{% endfor %}"


def bombs() -> list[tuple[dict[str, Any], str | None]]:
    """(request fields, the param a 400 must name or None when it may pass)."""
    big = LOOP * (200_000 // len(LOOP))  # template-like text, large enough to leave the hot path
    tool = {
        "type": "function",
        "function": {"name": "f", "description": big, "parameters": {"type": "object"}},
    }
    return [
        ({"chat_template_kwargs": {"chat_template": LOOP}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"tokenize": True, "chat_template": LOOP}}, None),
        ({"chat_template_kwargs": {"custom": LOOP[:4000], "enable_thinking": True}}, None),
        ({"messages": [{"role": "user", "content": big}]}, None),
        ({"messages": [{"role": "user", "content": LOOP}] * 200}, None),
        ({"tools": [tool], "tool_choice": "none"}, None),
        ({"documents": [{"title": "t", "text": big}]}, None),
        ({"chat_template": LOOP}, None),
    ]


def test_template_bombs_leave_other_tenants_answering(
    stores: Stores, tiny_model: Path, logs_dir: Path, services
) -> None:
    env = stack_env(
        stores,
        tiny_model,
        MODEL,
        LLMQ_ALLOW_CUSTOM_CHAT_TEMPLATE="true",
        LLMQ_CHAT_TEMPLATE_TIMEOUT_SECONDS="1",
    )
    api = ApiProcess(env, logs_dir / "templates-api.log")
    attacker = httpx.Client(
        base_url=api.url,
        headers={"Authorization": f"Bearer {services.keys.create_key('t-bomb')}"},
        timeout=120,
    )
    victim = httpx.Client(
        base_url=api.url,
        headers={"Authorization": f"Bearer {services.keys.create_key('t-calm')}"},
        timeout=30,
    )
    stop = threading.Event()
    answered: list[int] = []
    wrong: list[str] = []

    def attack(fields: dict[str, Any], param: str | None) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}
        while not stop.is_set():
            r = attacker.post("/v2/jobs", json=body)
            answered.append(r.status_code)
            if param is not None and (r.status_code != 400 or r.json()["error"]["param"] != param):
                wrong.append(f"{param}: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=attack, args=b, daemon=True) for b in bombs() for _ in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(answered) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.2)  # the sandbox children have started: the attack is at full strength
        slowest = 0.0
        calm = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
        end = time.monotonic() + 20
        count = 0
        while time.monotonic() < end:
            started = time.monotonic()
            r = victim.post("/v2/jobs", json=calm)
            slowest = max(slowest, time.monotonic() - started)
            assert r.status_code == 202, r.text
            count += 1
            time.sleep(0.1)
        print(f"victim: {count} requests, slowest {slowest:.2f} s; attacker: {len(answered)} answers")
        assert slowest < 2.0, f"another tenant waited {slowest:.2f} s during the bombs"
        assert count > 20
        assert not wrong, wrong[:3]
        assert len(answered) > len(threads)  # the attack kept going throughout
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        api.stop()
