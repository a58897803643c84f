"""The template sandbox pool on the tiny model: the model's own template with user kwargs
renders the same prompt as in-process; a render that overruns is killed within its limit,
is a 400 naming the field, and the pool serves the next render with a fresh child."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from app.domain.prompts import ChatRenderer
from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request
from app.services.template_sandbox import TemplateSandbox
from tests.helpers import Stack, run

pytestmark = pytest.mark.integration

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


def req(**fields: Any) -> ChatCompletionV2Request:
    return ChatCompletionV2Request.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.fixture(scope="module")
def sandbox(tiny_model: Path) -> Iterator[TemplateSandbox]:
    pool = TemplateSandbox(str(tiny_model), timeout=1.0, max_output=10**7, processes=1)
    yield pool
    pool.close()


def test_kwargs_render_in_the_sandbox_like_in_process(tiny_model: Path, sandbox: TemplateSandbox) -> None:
    renderer = ChatRenderer.load(
        str(tiny_model), sandbox=sandbox, custom_templates=True, inprocess_max_bytes=1000
    )
    trusted = renderer.render(req())
    assert renderer.render(req(chat_template_kwargs={"unused_variable": "x"})) == trusted
    long = [{"role": "user", "content": "word " * 1000}]
    assert renderer.render(req(messages=long)) == ChatRenderer.load(str(tiny_model)).render(
        req(messages=long)
    )


def sandbox_children() -> set[int]:
    """This process's template-sandbox children (the suite has other children too)."""
    found = set()
    for child in psutil.Process().children():
        try:
            if "template_sandbox" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


def test_an_overrun_is_killed_and_the_child_replaced(tiny_model: Path, sandbox: TemplateSandbox) -> None:
    renderer = ChatRenderer.load(str(tiny_model), sandbox=sandbox, custom_templates=True)
    renderer.render(req(chat_template_kwargs={"warm": True}))  # the child is up
    before = sandbox_children()
    assert before
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as exc:
        renderer.render(req(chat_template=LOOP))
    assert time.monotonic() - started < 3
    assert exc.value.param == "chat_template" and "within 1 s" in exc.value.message
    assert not before & sandbox_children()  # killed and reaped
    assert renderer.render(req(chat_template_kwargs={"again": 1}))  # a fresh child serves


def test_worker_renders_kwargs_jobs(stack: Stack) -> None:
    plain = run(stack, max_tokens=2)
    with_kwargs = run(stack, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert with_kwargs["status"] == "succeeded", with_kwargs
    assert with_kwargs["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_children_run_at_a_lower_cpu_priority(tiny_model: Path, sandbox: TemplateSandbox) -> None:
    """A bomb burning its time limit gets only the CPU other tenants' requests leave."""
    ChatRenderer.load(str(tiny_model), sandbox=sandbox).render(req(chat_template_kwargs={"warm": True}))
    children = sandbox_children()
    assert children
    mine = psutil.Process().nice()
    assert all(psutil.Process(pid).nice() >= mine + 10 for pid in children)
