"""The startup heap (app/heap.py): frozen once a process is up, so that collections skip
it; what is made later is collected as before, and a frozen object is still freed when
nothing refers to it."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from app import gunicorn_conf, heap
from app.api import warm_tokenizers
from app.services.models import ServedModel
from app.services.tokenizers import PromptCounters
from app.settings import Settings


class Thing:
    pass


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("unfrozen")
def test_what_exists_when_frozen_is_skipped_and_what_comes_later_is_not() -> None:
    startup = [Thing() for _ in range(1000)]
    assert heap.freeze_startup_heap() >= 1000
    later = [Thing() for _ in range(1000)]
    gc.collect()
    collected = {id(o) for o in gc.get_objects()}  # what collections walk: not the frozen
    assert not any(id(t) in collected for t in startup)
    assert all(id(t) in collected for t in later)
    gone = weakref.ref(startup[0])
    del startup
    assert gone() is None  # refcounting still frees a frozen object


@pytest.mark.usefixtures("unfrozen")
def test_gunicorn_freezes_each_worker_once_it_has_loaded_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "freeze_startup_heap", lambda: calls.append(1) or 0)
    gunicorn_conf.post_worker_init(None)
    assert calls == [1]


@pytest.mark.usefixtures("unfrozen")
def test_what_a_served_apis_tokenizer_load_brings_is_frozen() -> None:
    """The API's tokenizers load after its startup heap was frozen (transformers and torch:
    about 200,000 objects); the served app freezes again once each has loaded."""
    made: list[list[Thing]] = []

    class Renderer:
        def close(self) -> None:
            pass

    def load(source: str) -> Any:
        made.append([Thing() for _ in range(1000)])  # what an import leaves behind
        return Renderer()

    counters = PromptCounters(Settings(), size=2, load=load)
    models = SimpleNamespace(all=lambda: {"m": ServedModel("m", tokenizers=("tok",))})
    warm_tokenizers(cast(Any, SimpleNamespace(tokenizers=counters, models=models)))
    for thread in threading.enumerate():
        if thread.name == "llmq-tokenizers-warm":
            thread.join(10)
    assert counters.loaded() == ["tok"] and made
    collected = {id(o) for o in gc.get_objects()}
    assert not any(id(t) in collected for t in made[0])
