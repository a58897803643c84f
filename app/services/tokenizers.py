"""Prompt counting in the API, per model, with tokenizers loaded on first use.

The API counts a request's prompt tokens with the model's own tokenizer and template to
refuse a prompt over the context before queuing it. Which tokenizer is the model's comes
from the registry (a folder or a Hugging Face name the worker loaded); the API uses it only
when it can be read here without the network (a folder this machine has, or a name in the
local Hugging Face cache). Otherwise the request is queued and the worker, which renders
every prompt, fails the job alone with the same error (app/domain/budget.py).

Bounded memory: at most `size` renderers (a tokenizer and its template sandbox) per API
process, the least recently used dropped first. A served API process warms the tokenizers
of the models it knows at start, in the background (`warm`; app/api/__init__.py): a load
takes seconds (transformers' import, the tokenizer files), longer on a busy host, and a
request that needs a tokenizer waits for its load, so the first requests of a process must
not be the ones that pay for it. A load runs in a native thread when gevent runs this
process, so the API's event loop keeps serving while a tokenizer is read (the GIL is
handed back every few milliseconds).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from app.domain.text_prompt import prompt_ids
from app.domain.tools import plan_tools
from app.schemas.text_completion import CompletionRequest, JobRequest
from app.services.model_files import has_tokenizer, local_folder
from app.services.models import PromptCounter, ServedModel
from app.settings import Settings

if TYPE_CHECKING:
    from app.domain.prompts import ChatRenderer

log = logging.getLogger("llmq.tokenizers")

# A source that could not be loaded is not tried again for this long (a folder mounted or
# a cache filled later is found after it).
RETRY_SECONDS = 30.0

T = TypeVar("T")


def off_loop(fn: Callable[[], T]) -> T:
    """`fn()` in a native thread when gevent has patched this process (the calling greenlet
    waits, the others run), else in the calling thread."""
    if "gevent" in sys.modules:
        from gevent import get_hub, monkey

        if monkey.is_module_patched("threading"):
            result: T = get_hub().threadpool.apply(fn)
            return result
    return fn()


class PromptCounters:
    """`counter(model)`: a token counter for the first of the model's tokenizer sources
    that loads here, or None."""

    def __init__(
        self,
        settings: Settings,
        *,
        size: int,
        load: Callable[[str], ChatRenderer] | None = None,
        resolve: Callable[[str], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._size = size
        self._load = load or self._load_renderer
        self._resolve = resolve or _resolve
        self._clock = clock
        self._loaded: OrderedDict[str, ChatRenderer] = OrderedDict()
        self._failed: dict[str, float] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        # Told once each tokenizer has loaded and those it pushed out of the cache were
        # dropped (outside the cache's lock; requests for that source still wait on its
        # load's): the served app collects and freezes its heap then (app/heap.py).
        self.after_load: Callable[[], object] | None = None

    def counter(self, model: ServedModel) -> PromptCounter | None:
        for source in model.tokenizers:
            renderer = self.renderer(source)
            if renderer is not None:
                return self._count_with(renderer)
        return None

    def warm(self, models: Iterable[ServedModel]) -> None:
        """Load the tokenizers of `models` (at most `size` of them) now, so that no request
        waits for the load; a source that cannot be read here is logged and skipped."""
        for model in list(models)[: self._size]:
            self.counter(model)  # a failed load is logged and remembered by `renderer`

    def _count_with(self, renderer: ChatRenderer) -> PromptCounter:
        parser = self._settings.tool_call_parser

        def count(req: JobRequest) -> int:
            if isinstance(req, CompletionRequest):
                # Encoding a long prompt takes a while: off the gevent loop, as a template
                # render over a large request is.
                return len(off_loop(lambda: prompt_ids(req, renderer)))
            return len(renderer.render(req, plan_tools(req, auto_parser=parser)))

        return count

    def loaded(self) -> list[str]:
        """The sources loaded now, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def renderer(self, source: str) -> ChatRenderer | None:
        with self._lock:
            if source in self._loaded:
                self._loaded.move_to_end(source)
                return self._loaded[source]
            failed = self._failed.get(source)
            if failed is not None and self._clock() - failed < RETRY_SECONDS:
                return None
            gate = self._loading.setdefault(source, threading.Lock())
        with gate:  # one load per source; others asking for it wait for that one
            with self._lock:
                if source in self._loaded:
                    return self._loaded[source]
            try:
                renderer = self._load(source)
            except Exception as exc:  # noqa: BLE001 - not reachable here: the worker checks
                with self._lock:
                    self._failed[source] = self._clock()
                    self._loading.pop(source, None)
                log.info(
                    "no tokenizer here for this model; the worker checks prompt lengths",
                    extra={"source": source, "error": f"{type(exc).__name__}: {exc}"[:200]},
                )
                return None
            with self._lock:
                self._failed.pop(source, None)
                self._loading.pop(source, None)
                self._loaded[source] = renderer
                evicted = []
                while len(self._loaded) > self._size:
                    evicted.append(self._loaded.popitem(last=False))
            _drop(evicted)  # none referred to from here on: the hook's collection frees them
            if self.after_load is not None:
                self.after_load()
            return renderer

    def _load_renderer(self, source: str) -> ChatRenderer:
        from app.container import template_sandbox
        from app.domain.prompts import ChatRenderer

        folder = self._resolve(source)
        if folder is None:
            raise LookupError("neither a folder on this machine nor in the local Hugging Face cache")
        from transformers import AutoTokenizer

        # Only reading the tokenizer goes to a native thread: transformers' import spawns a
        # subprocess (ctypes.util), which gevent allows on its main loop only, and the
        # sandbox's queue and locks are made here, on the thread (and gevent hub) whose
        # requests will wait on them. The import takes seconds once per process, which is
        # why the served app warms its tokenizers at start.
        tokenizer = off_loop(lambda: AutoTokenizer.from_pretrained(folder))
        # gevent workers: a render with user input must never run in this process (it would
        # block every greenlet); the sandbox children render it under the time limit.
        renderer = ChatRenderer(
            tokenizer,
            sandbox=template_sandbox(self._settings, folder),
            custom_templates=False,  # the API does not count user templates (the worker renders them)
            inprocess_max_bytes=self._settings.inprocess_render_max_bytes,
        )
        log.info("tokenizer loaded", extra={"source": source, "folder": folder})
        return renderer

    def close(self) -> None:
        with self._lock:
            loaded, self._loaded = list(self._loaded.values()), OrderedDict()
        for renderer in loaded:
            renderer.close()


def _drop(evicted: list[tuple[str, ChatRenderer]]) -> None:
    """Close the renderers dropped from the cache, emptying the list."""
    while evicted:
        source, old = evicted.pop()
        old.close()
        log.info("tokenizer dropped (least recently used)", extra={"source": source})


def _resolve(source: str) -> str | None:
    folder = local_folder(source)
    return str(folder) if folder is not None and has_tokenizer(folder) else None
