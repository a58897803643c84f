"""Which models this deployment serves: models are data, not a setting of the API.

A model is served when a live worker serves it (each worker registers the model it runs,
with its context length, in-flight capacity and tokenizer source, in its registry entry:
app/services/health.py), or when the operator declares it (`LLMQ_MODELS`, and the model of
the API's own `LLMQ_MODEL`/`LLMQ_SERVED_MODEL_NAME`, as under `llmq up`). A declared model's
jobs queue while no worker runs (scale from zero); any other model is a 404.

Reads of the registry are cached for `ttl_seconds` (about a second): a request never scans
Redis, and a worker that joins or leaves is seen that much later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.schemas.text_completion import JobRequest
from app.services.model_files import context_length, read_config, vocab_size
from app.settings import Settings

log = logging.getLogger("llmq.models")

# A request's prompt tokens: a chat request rendered through its template, a text
# completion's prompt encoded (app/services/tokenizers.py).
PromptCounter = Callable[[JobRequest], int]


@dataclass(frozen=True)
class ServedModel:
    """One model as the registry and the settings describe it."""

    name: str
    declared: bool = False
    # One entry per live worker serving it: that worker's in-flight capacity (jobs at once).
    capacities: tuple[int, ...] = ()
    # The context length in tokens: the smallest a live worker's engine reports, else the
    # declared one; None when neither is known (the worker then checks alone).
    max_model_len: int | None = None
    vocab_size: int | None = None
    # Where its tokenizer may be loaded from (a folder or a Hugging Face name), best first.
    tokenizers: tuple[str, ...] = field(default=())

    @property
    def live(self) -> bool:
        return bool(self.capacities)

    @property
    def capacity(self) -> int:
        """Jobs its live workers run at once, all together (0: none live)."""
        return sum(self.capacities)


def declared_models(settings: Settings) -> list[ServedModel]:
    """`LLMQ_MODELS`, and the model the API's own `LLMQ_MODEL`/`LLMQ_SERVED_MODEL_NAME`
    names (with what its local folder says, read now: a small JSON file)."""
    out = {name: ServedModel(name, declared=True) for name in settings.declared_models}
    if settings.model or settings.served_model_name:
        folder = Path(settings.model) if settings.model and Path(settings.model).is_dir() else None
        config = read_config(folder)
        out[settings.model_name] = ServedModel(
            settings.model_name,
            declared=True,
            max_model_len=settings.max_model_len or context_length(config),
            vocab_size=vocab_size(config),
            tokenizers=(settings.model,) if settings.model else (),
        )
    return list(out.values())


def merge(workers: Iterable[dict[str, Any]], declared: Iterable[ServedModel]) -> dict[str, ServedModel]:
    """The served models: every declared one, and every one a live worker serves, with
    what the workers report taking precedence over what was declared."""
    models = {m.name: m for m in declared}
    by_model: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        if w.get("model"):
            by_model.setdefault(str(w["model"]), []).append(w)
    for name, group in by_model.items():
        known = models.get(name, ServedModel(name))
        lengths = [int(w["max_model_len"]) for w in group if w.get("max_model_len")]
        vocabs = [int(w["vocab_size"]) for w in group if w.get("vocab_size")]
        sources = [*known.tokenizers, *(str(w["tokenizer"]) for w in group if w.get("tokenizer"))]
        models[name] = ServedModel(
            name,
            declared=known.declared,
            capacities=tuple(int(w.get("capacity") or 0) for w in group),
            max_model_len=min(lengths) if lengths else known.max_model_len,
            vocab_size=vocabs[0] if vocabs else known.vocab_size,
            tokenizers=tuple(dict.fromkeys(sources)),
        )
    return models


class ModelRegistry:
    """The served models, from the worker registry (read at most every `ttl_seconds`) and
    the declared ones. When Redis cannot be read, the last view stands (declared models
    only before the first read)."""

    def __init__(
        self,
        read_workers: Callable[[], list[dict[str, Any]]],
        *,
        declared: Iterable[ServedModel] = (),
        ttl_seconds: float = 1.0,
        counters: Callable[[ServedModel], PromptCounter | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read_workers
        self._declared = list(declared)
        self._ttl = ttl_seconds
        self._counters = counters
        self._clock = clock
        self._lock = threading.Lock()
        self._view: dict[str, ServedModel] = merge([], self._declared)
        self._read_at: float | None = None

    def all(self) -> dict[str, ServedModel]:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self._ttl:
            return self._view
        with self._lock:  # one reader refreshes; the others wait for its view
            if self._read_at is not None and self._clock() - self._read_at < self._ttl:
                return self._view
            try:
                self._view = merge(self._read(), self._declared)
            except Exception as exc:  # noqa: BLE001 - Redis away: the last view stands
                log.warning("worker registry unreadable", extra={"error": type(exc).__name__})
            self._read_at = self._clock()
            return self._view

    def get(self, name: str) -> ServedModel | None:
        """The model, or None when it is neither declared nor served by a live worker."""
        return self.all().get(name)

    def names(self) -> frozenset[str]:
        return frozenset(self.all())

    def prompt_counter(self, model: ServedModel) -> PromptCounter | None:
        """Counts a request's prompt tokens with the model's own tokenizer and template,
        when one is reachable from here; else None (the worker checks the length)."""
        return self._counters(model) if self._counters is not None else None
