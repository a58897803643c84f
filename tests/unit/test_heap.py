"""The startup heap (app/heap.py): frozen once a process is up, so that collections skip
it; what is made later is collected as before, and a frozen object is still freed when
nothing refers to it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
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


@pytest.mark.usefixtures("unfrozen")
def test_a_tokenizer_dropped_from_a_served_apis_cache_is_collected_at_the_next_load() -> None:
    """A frozen object that becomes garbage in a cycle is never collected: the freeze after
    a load unfreezes first, so what the load pushed out of the cache goes."""

    class Renderer:
        def __init__(self) -> None:
            self.me = self  # a cycle, as a tokenizer and its template environment hold

        def close(self) -> None:
            pass

    counters = PromptCounters(Settings(), size=1, load=lambda source: Renderer())
    warm_tokenizers(cast(Any, SimpleNamespace(tokenizers=counters, models=SimpleNamespace(all=dict))))
    first = weakref.ref(counters.renderer("a"))  # loaded, then frozen with the rest
    assert first() is not None and gc.is_tracked(first())
    counters.renderer("b")  # pushes "a" out
    assert counters.loaded() == ["b"]
    assert first() is None


def test_what_froze_and_became_garbage_is_finalized_as_the_process_exits() -> None:
    """Else an extension that counts its objects (triton's nanobind, in the API once torch is
    imported) reports them as leaked on stderr, a line that is not JSON in the log."""
    script = """
from app import heap

class Held:
    def __init__(self):
        self.me = self  # a cycle: only a collection frees it

    def __del__(self):
        print("finalized", flush=True)

held = Held()
heap.freeze_startup_heap()
del held
print("exiting", flush=True)
"""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["exiting", "finalized"]
