"""Models are data: the registry's view of served models, the 404 for any other, prompt
counting per model with a bounded set of tokenizers, and the feeder's window formula."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.domain.budget import completion_budget, estimate_prompt_tokens
from app.errors import InvalidRequest, NotFound
from app.schemas.chat import ChatCompletionV2Request
from app.services.contract import RequestPolicy
from app.services.dispatch import dispatch_plan
from app.services.files import LineChecker
from app.services.models import ModelRegistry, ServedModel, declared_models, merge
from app.services.tokenizers import PromptCounters
from app.settings import Settings


def worker(model: str, **info: Any) -> dict[str, Any]:
    return {"name": f"w-{model}-{len(info)}", "model": model, "capacity": 128, "consuming": True, **info}


def req(model: str, content: str = "hi", **fields: Any) -> ChatCompletionV2Request:
    return ChatCompletionV2Request.model_validate(
        {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    )


# --- the registry -------------------------------------------------------------------------


def test_served_models_are_the_live_ones_and_the_declared_ones() -> None:
    workers = [
        worker("a", max_model_len=4096, tokenizer="/models/a", capacity=64),
        worker("a", max_model_len=2048, tokenizer="org/a", capacity=32, vocab_size=500),
        worker("b", max_model_len=8192),
    ]
    models = merge(workers, [ServedModel("c", declared=True)])
    assert sorted(models) == ["a", "b", "c"]
    a = models["a"]
    assert a.live and a.capacities == (64, 32) and a.capacity == 96
    assert a.max_model_len == 2048  # the smallest engine's: what every worker can run
    assert a.tokenizers == ("/models/a", "org/a") and a.vocab_size == 500
    assert not models["c"].live and models["c"].declared and models["c"].max_model_len is None


def test_a_declared_model_takes_what_its_live_workers_report() -> None:
    declared = ServedModel("a", declared=True, max_model_len=1024, tokenizers=("/api/a",))
    a = merge([worker("a", max_model_len=4096, tokenizer="/models/a")], [declared])["a"]
    assert a.declared and a.live and a.max_model_len == 4096
    assert a.tokenizers == ("/api/a", "/models/a")  # the API's own folder first


def test_the_apis_own_model_and_llmq_models_are_declared(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 3072, "vocab_size": 77}))
    settings = Settings(model=str(tmp_path), served_model_name="local", models="x, y,x")
    found = {m.name: m for m in declared_models(settings)}
    assert sorted(found) == ["local", "x", "y"]
    assert (found["local"].max_model_len, found["local"].vocab_size) == (3072, 77)
    assert found["local"].tokenizers == (str(tmp_path),)
    assert [m.name for m in declared_models(Settings())] == []  # nothing configured: none


def test_registry_reads_are_cached_and_survive_an_unreadable_registry() -> None:
    now = [0.0]
    reads: list[int] = []
    workers: list[dict[str, Any]] = [worker("a")]

    def read() -> list[dict[str, Any]]:
        reads.append(1)
        if workers and workers[0].get("model") == "broken":
            raise ConnectionError("redis away")
        return list(workers)

    registry = ModelRegistry(read, ttl_seconds=1.0, clock=lambda: now[0])
    assert registry.names() == {"a"} and registry.names() == {"a"}
    assert len(reads) == 1
    workers[:] = [worker("b")]
    now[0] = 0.5
    assert registry.names() == {"a"}  # within the TTL: the cached view
    now[0] = 1.5
    assert registry.names() == {"b"} and len(reads) == 2
    workers[:] = [worker("broken")]
    now[0] = 3.0
    assert registry.names() == {"b"}  # unreadable: the last view stands


def test_a_model_neither_declared_nor_live_is_a_404_naming_model() -> None:
    policy = RequestPolicy(
        Settings(), ModelRegistry(lambda: [worker("a")], declared=[ServedModel("c", True)])
    )
    policy.check(req("a"))
    policy.check(req("c"))
    with pytest.raises(NotFound) as exc:
        policy.check(req("nope"))
    assert (exc.value.status, exc.value.param, exc.value.code) == (404, "model", "model_not_found")
    assert "served: a, c" in exc.value.message


def test_context_and_vocabulary_are_checked_per_model() -> None:
    workers = [worker("short", max_model_len=100, vocab_size=50), worker("long", max_model_len=1000)]
    registry = ModelRegistry(lambda: workers, counters=lambda m: lambda r: 95)
    policy = RequestPolicy(Settings(), registry)
    policy.check(req("long", max_tokens=500, logit_bias={"60": 1}))
    with pytest.raises(InvalidRequest) as exc:
        policy.check(req("short", max_tokens=10))
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest) as exc:
        policy.check(req("short", logit_bias={"60": 1}))
    assert exc.value.param == "logit_bias"


def test_the_api_and_the_worker_refuse_a_long_prompt_with_the_same_error() -> None:
    """With no reachable tokenizer the worker applies the same rule (app/domain/budget.py):
    the job fails with the error the API would have answered."""
    registry = ModelRegistry(lambda: [worker("m", max_model_len=100)], counters=lambda m: lambda r: 120)
    with pytest.raises(InvalidRequest) as api:
        RequestPolicy(Settings(), registry).check(req("m"))
    with pytest.raises(InvalidRequest) as in_worker:
        completion_budget(req("m"), 120, 100)
    assert api.value.body() == in_worker.value.body()


def test_an_uploads_lines_look_their_model_and_tokenizer_up_once() -> None:
    """The lines of one upload share a memo: the model and its prompt counter are looked up
    once per model name, and every line is still counted with the model's own tokenizer."""
    lookups: list[str] = []

    def counter(model: ServedModel) -> Callable[[Any], int]:
        lookups.append(model.name)
        return lambda r: 7

    registry = ModelRegistry(lambda: [worker("a", max_model_len=100), worker("b")], counters=counter)
    policy = RequestPolicy(Settings(), registry)
    memo: dict[str, Any] = {}
    budgets = [policy.budget_tokens(req(m, max_tokens=3), memo) for m in ("a", "a", "b", "a", "b")]
    assert budgets == [10] * 5
    assert lookups == ["a", "b"]
    policy.budget_tokens(req("a", max_tokens=3))  # without a memo: looked up again
    assert lookups == ["a", "b", "a"]


def test_an_upload_counts_prompts_with_the_tokenizer_only_when_asked() -> None:
    """A file uploaded while its tenant has no batch token budget takes the estimate for
    each line (counting with the tokenizer is most of an upload's time); with one, the
    model's own count."""
    counted: list[str] = []

    def counter(model: ServedModel) -> Callable[[Any], int]:
        return lambda r: counted.append(r.model) or 7

    policy = RequestPolicy(Settings(), ModelRegistry(lambda: [worker("a")], counters=counter))
    body = {"model": "a", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 3}
    raw = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body})
    estimate = estimate_prompt_tokens(ChatCompletionV2Request.model_validate(body))
    assert estimate > 7
    assert LineChecker(policy, exact_tokens=False).check(1, raw.encode())[2] == estimate + 3
    assert counted == []
    assert LineChecker(policy, exact_tokens=True).check(1, raw.encode())[2] == 7 + 3
    assert counted == ["a"]


# --- tokenizers ---------------------------------------------------------------------------


class FakeRenderer:
    def __init__(self, source: str) -> None:
        self.source = source
        self.closed = False

    def render(self, req: ChatCompletionV2Request, plan: object = None) -> list[int]:
        return [0] * len(self.source)

    def close(self) -> None:
        self.closed = True


def test_tokenizers_load_on_first_use_and_the_least_recently_used_is_dropped() -> None:
    loads: list[str] = []
    made: dict[str, FakeRenderer] = {}

    def load(source: str) -> Any:
        loads.append(source)
        made[source] = FakeRenderer(source)
        return made[source]

    counters = PromptCounters(Settings(), size=2, load=load)
    assert loads == []  # nothing at start
    one, two, three = (ServedModel(n, tokenizers=(n * k,)) for n, k in (("a", 1), ("b", 2), ("c", 3)))
    count = counters.counter(one)
    assert count is not None and count(req("a")) == 1
    counters.counter(two)
    counters.counter(one)  # a is the most recently used now
    counters.counter(three)
    assert loads == ["a", "bb", "ccc"]
    assert counters.loaded() == ["a", "ccc"] and made["bb"].closed and not made["a"].closed


def loader(attempts: list[str]) -> Callable[[str], Any]:
    """A renderer loader that records each source tried; "/not/here" is not on this machine."""

    def load(source: str) -> Any:
        attempts.append(source)
        if source == "/not/here":
            raise LookupError("not on this machine")
        return FakeRenderer(source)

    return load


def test_an_unreachable_tokenizer_leaves_counting_to_the_worker_and_is_retried_later() -> None:
    now = [0.0]
    attempts: list[str] = []
    counters = PromptCounters(Settings(), size=2, load=loader(attempts), clock=lambda: now[0])
    gone = ServedModel("m", tokenizers=("/not/here",))
    assert counters.counter(gone) is None
    assert counters.counter(gone) is None and attempts == ["/not/here"]  # not retried at once
    now[0] = 31.0
    counters.counter(gone)
    assert attempts == ["/not/here", "/not/here"]
    # A second source is tried when the first cannot load.
    count = counters.counter(ServedModel("m", tokenizers=("/not/here", "ok")))
    assert count is not None and count(req("m")) == 2


def test_warm_loads_the_known_models_tokenizers_up_to_the_cache_size() -> None:
    loads: list[str] = []
    counters = PromptCounters(Settings(), size=2, load=loader(loads))
    models = [ServedModel(n, tokenizers=(src,)) for n, src in (("a", "/not/here"), ("b", "bb"), ("c", "cc"))]
    counters.warm(models)  # one that cannot load is skipped, the next still loads
    assert loads == ["/not/here", "bb"] and counters.loaded() == ["bb"]
    count = counters.counter(models[1])
    assert count is not None and count(req("b")) == 2 and loads == ["/not/here", "bb"]  # no second load


def test_each_tokenizer_load_is_told_once_it_has_loaded() -> None:
    """Not a cached answer, nor a load that failed (the served app freezes its heap then)."""
    loads: list[str] = []
    told: list[list[str]] = []
    counters = PromptCounters(Settings(), size=2, load=loader(loads))
    counters.after_load = lambda: told.append(counters.loaded())
    counters.counter(ServedModel("a", tokenizers=("/not/here", "aa")))
    counters.counter(ServedModel("a", tokenizers=("aa",)))
    counters.counter(ServedModel("b", tokenizers=("bb",)))
    assert loads == ["/not/here", "aa", "bb"]
    assert told == [["aa"], ["aa", "bb"]]  # each after its renderer was in the cache


def test_a_model_folder_that_is_not_here_is_not_looked_up_as_a_name() -> None:
    from app.services.model_files import local_folder

    assert local_folder("/models/absent-on-this-machine") is None
    assert local_folder(None) is None
    assert local_folder("not a valid :: name") is None  # refused by the hub's name check: not here


# --- dispatch -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacities", "ceiling", "window", "chunk"),
    [
        ([512], None, 768, 32),  # one worker at max_num_seqs 256: 1.5 x 512
        ([512] * 8, None, 6144, 32),  # eight: eight times the lines out
        ([512, 512], 1000, 1000, 32),  # the optional ceiling caps it
        ([64], None, 96, 16),  # a small worker gets small chunks: a quarter of its capacity
        ([], None, 256, 32),  # none live (scale from zero): the cold window
        ([0], None, 256, 32),  # a worker reporting no capacity counts as none
        ([2], None, 3, 1),
    ],
)
def test_the_window_follows_live_capacity(
    capacities: list[int], ceiling: int | None, window: int, chunk: int
) -> None:
    plan = dispatch_plan(capacities, headroom=1.5, chunk=32, cold_window=256, ceiling=ceiling)
    assert (plan.window, plan.chunk) == (window, chunk)


def test_the_window_shrinks_when_workers_go() -> None:
    sizes = [dispatch_plan([128] * n, headroom=1.5, chunk=32, cold_window=64).window for n in (4, 2, 1, 0)]
    assert sizes == [768, 384, 192, 64]
