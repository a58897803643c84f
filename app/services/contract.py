"""Which request fields this deployment honours, and the bounds it enforces.

Nothing is accepted and ignored: a field is honoured (see `HONOURED` and the checks
below), or set to its neutral value (the value that changes nothing), or the request is
refused with a 400 naming it. The refusals say why: most come from what the installed vLLM
(0.32) can do, the rest from what this deployment serves (a text-only model).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from app.domain.budget import completion_budget, estimate_chat_tokens, estimate_prompt_tokens, line_tokens
from app.domain.metadata import check_metadata
from app.domain.structured import Constraint, ConstraintLimits, check_limits, constraint_of
from app.domain.tools import ToolPlan, plan_tools
from app.errors import InvalidRequest, LlmqError, NotFound, Unsupported
from app.schemas.chat import ChatCompletionV2Request, ImagePart, TextPart
from app.schemas.plain_line import PlainChatBody
from app.services.addresses import Resolver, system_resolver, url_refusal
from app.services.models import PromptCounter, ServedModel
from app.settings import Settings

if TYPE_CHECKING:
    from app.schemas.text_completion import CompletionRequest

# Fields the engine path implements (some with conditions, checked in `check`).
HONOURED: frozenset[str] = frozenset(
    {
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "ignore_eos",
        "priority",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "stop_token_ids",
        "include_stop_str_in_output",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "logprobs",
        "top_logprobs",
        # Chat template rendering.
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        # Structured outputs (see app/domain/structured.py).
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "response_format",
        # Tools (see app/domain/tools.py).
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        # `best_of` equal to `n` (the only value without beam search).
        "best_of",
        # Streaming: the chat endpoints relay SSE; see `check` for POST /v2/jobs.
        "stream",
        "stream_options",
        # Stored with the job, returned on it.
        "metadata",
        "user",
        "service_tier",
        "store",
    }
)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


# Fields not honoured, with the value that asks for nothing.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "modalities": _is(["text"]),
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0),
    "early_stopping": _is(False),
}

WHY_UNSUPPORTED: dict[str, str] = {
    "modalities": "this engine generates text only",
    "audio": "this engine does not generate audio",
    "prediction": "predicted outputs are not supported by vLLM",
    "web_search_options": "this engine has no web search",
    "reasoning_effort": "the served model has no reasoning-effort control",
    "use_beam_search": "beam search is not available through vLLM 0.32's AsyncLLM",
    "length_penalty": "it applies to beam search, which vLLM 0.32's AsyncLLM does not offer",
    "early_stopping": "it applies to beam search, which vLLM 0.32's AsyncLLM does not offer",
    "guided_whitespace_pattern": "vLLM 0.32 ignores a per-request whitespace pattern; whitespace in "
    "JSON output is set for the whole engine (none between tokens)",
}

LOGIT_BIAS_RANGE = 100.0
# Served models named in a 404's message, at most.
MODELS_LISTED = 20

# `chat_template_kwargs` reach `apply_chat_template(**kwargs)` and then the template's render
# call, so a key there can replace the template, switch tokenization on, pad, truncate, or
# shadow what the template itself relies on. Only plain template variables pass: a name
# like an identifier that is none of these (the installed transformers' `apply_chat_template`
# parameters, what `render_jinja_template` passes, the special tokens it adds, and the
# globals of its Jinja environment).
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
RESERVED_TEMPLATE_KWARGS: frozenset[str] = frozenset(
    {
        # apply_chat_template's own parameters
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tokenizer",
        # what render_jinja_template passes and uses
        "conversations",
        "messages",
        "kwargs",
        # special tokens (kwargs overwrite the tokenizer's)
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        # globals of the template's Jinja environment
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "namespace",
        "lipsum",
        "cycler",
        "joiner",
        "loop",
        "self",
        "varargs",
    }
)


class ModelCatalog(Protocol):
    """The served models (app/services/models.py's `ModelRegistry`)."""

    def get(self, name: str) -> ServedModel | None: ...

    def names(self) -> frozenset[str]: ...

    def prompt_counter(self, model: ServedModel) -> PromptCounter | None: ...


# Per upload: a model name's model and prompt counter, looked up once for all its lines.
CounterMemo = dict[str, tuple[ServedModel | None, PromptCounter | None]]


def model_and_counter(
    models: ModelCatalog, name: str, memo: CounterMemo | None
) -> tuple[ServedModel | None, PromptCounter | None]:
    """The model named `name` and its prompt counter (None where not reachable from here);
    with `memo`, the first answer for a name stands for the rest of the upload (looked up
    per line, through the tokenizer cache's lock, it was about 1.3 µs of a line's 16)."""
    if memo is not None and (known := memo.get(name)) is not None:
        return known
    model = models.get(name)
    found = (model, models.prompt_counter(model) if model is not None else None)
    if memo is not None:
        memo[name] = found
    return found


class ConstraintChecker(Protocol):
    """Compiles a constraint where a crash costs nothing (`app.services.sandbox`)."""

    def check(self, found: Constraint) -> None: ...


class RequestPolicy:
    """Checks a parsed request against what this deployment runs. Raises, or returns."""

    def __init__(
        self,
        settings: Settings,
        models: ModelCatalog,
        *,
        constraints: ConstraintChecker | None = None,
    ) -> None:
        self._settings = settings
        self._models = models
        self._limits = ConstraintLimits.of(settings)
        self._constraints = constraints

    def check(
        self, req: ChatCompletionV2Request, *, streaming: bool = False, count_tokens: bool = True
    ) -> None:
        """`streaming`: the endpoint can answer `stream: true` (the chat endpoints can;
        `POST /v2/jobs` answers 202 and streams from `/v2/jobs/<id>/stream`).
        `count_tokens`: off for batch lines, where a prompt over the context fails its own line.

        Raises:
            NotFound: `model` is neither declared nor served by a live worker.
            Unsupported: a field set to something this deployment does not honour.
            InvalidRequest: a bound is exceeded or fields contradict each other.
        """
        model = self._models.get(req.model)
        if model is None:
            raise model_not_found(req.model, self._models.names())
        if req.stream and not streaming:
            raise InvalidRequest(
                "`stream: true` is for /v1/chat/completions and /v2/chat/completions; a queued "
                "job streams from GET /v2/jobs/<id>/stream",
                param="stream",
            )
        self._check_fields(req)
        check_metadata(req.metadata)
        self._check_sampling(req, model.vocab_size)
        self._check_template(req)
        self._check_output(req)
        check_bounds(req, self._settings)
        self._check_messages(req)
        if count_tokens:
            self._check_prompt_length(req, model)

    def _check_fields(self, req: ChatCompletionV2Request) -> None:
        for name in req.model_fields_set - HONOURED:
            value = getattr(req, name)
            if value is None:
                continue
            neutral = NEUTRAL.get(name)
            if neutral is not None and neutral(value):
                continue
            why = WHY_UNSUPPORTED.get(name, "this deployment does not honour it")
            raise Unsupported(f"`{name}` is not supported: {why}", param=name)

    def _check_sampling(self, req: ChatCompletionV2Request, vocab: int | None) -> None:
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise Unsupported(
                f"`best_of` {req.best_of} with `n` {n}: vLLM 0.32 generates exactly `n` sequences "
                "(best_of was removed); send best_of equal to n or leave it out",
                param="best_of",
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        check_logit_bias(req.logit_bias, vocab)
        check_token_ids(req.stop_token_ids, vocab, "stop_token_ids")
        if (
            req.min_tokens is not None
            and (limit := req.completion_limit()) is not None
            and req.min_tokens > limit
        ):
            raise InvalidRequest("`min_tokens` is above `max_tokens`", param="min_tokens")

    def _check_template(self, req: ChatCompletionV2Request) -> None:
        if req.continue_final_message and req.add_generation_prompt:
            raise InvalidRequest(
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
                param="continue_final_message",
            )
        if req.chat_template is not None:
            if not self._settings.allow_custom_chat_template:
                raise _template_refused("chat_template")
            if len(req.chat_template) > self._settings.max_chat_template_bytes:
                raise InvalidRequest(
                    f"`chat_template` is over {self._settings.max_chat_template_bytes} bytes",
                    param="chat_template",
                )
        if req.chat_template_kwargs:
            self._check_template_kwargs(req.chat_template_kwargs)

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        for key in kwargs:
            param = f"chat_template_kwargs.{key}"
            if key == "chat_template" and not self._settings.allow_custom_chat_template:
                raise _template_refused(param)
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequest(
                    f"`{param}` is refused: `chat_template_kwargs` holds plain template variables; "
                    f"`{key}` would replace the template or change how it is applied"
                    + (" (send a template as `chat_template`)" if key == "chat_template" else ""),
                    param=param,
                )
            if not _TEMPLATE_VARIABLE.fullmatch(key):
                raise InvalidRequest(
                    f"`chat_template_kwargs` keys are template variable names (a letter, then letters, "
                    f"digits or `_`, at most 64); got {key[:80]!r}",
                    param=param[:120],
                )
        limit = self._settings.max_chat_template_kwargs_bytes
        size = len(json.dumps(kwargs, separators=(",", ":")))
        if size > limit:
            raise InvalidRequest(
                f"`chat_template_kwargs` is {size} bytes as JSON; the limit is {limit}",
                param="chat_template_kwargs",
            )

    def _check_output(self, req: ChatCompletionV2Request) -> None:
        plan = plan_tools(req, auto_parser=self._settings.tool_call_parser)
        check_output(req, plan, self._settings, self._limits, self._constraints)

    def _check_messages(self, req: ChatCompletionV2Request) -> None:
        for i, msg in enumerate(req.messages):
            content = getattr(msg, "content", None)
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if isinstance(part, TextPart) or part.type == "refusal":
                    continue
                param = f"messages[{i}].content[{j}]"
                if isinstance(part, ImagePart):
                    resolve = system_resolver(self._settings.image_url_resolve_timeout_seconds)
                    unsafe = unsafe_url_reason(part.image_url.url, resolve)
                    if unsafe:
                        raise InvalidRequest(f"`image_url` refused: {unsafe}", param=f"{param}.image_url.url")
                raise Unsupported(
                    f"content part type `{part.type}` is not supported: the served model is text-only",
                    param=f"{param}.type",
                )

    def budget_tokens(
        self, req: ChatCompletionV2Request, memo: CounterMemo | None = None, *, exact: bool = True
    ) -> int:
        """A batch line's figure against the batch token budget (app/domain/budget.py's
        `line_tokens`), with the model's own prompt count when `exact`, this API has the
        model's tokenizer and the line brings no template of its own, else the estimate.
        `memo`: one upload's lookups (`model_and_counter`)."""
        model, count = model_and_counter(self._models, req.model, memo)
        prompt: int | None = None
        if exact and count is not None and req.chat_template is None:
            try:
                prompt = count(req)
            except LlmqError:
                prompt = None  # a line that cannot render fails on its own when it runs
        if prompt is None:
            prompt = estimate_prompt_tokens(req)
        context = model.max_model_len if model is not None else None
        return line_tokens(req, prompt, context, self._settings.max_tokens_limit)

    def plain_line_tokens(self, body: PlainChatBody, memo: CounterMemo) -> int | None:
        """A plain line's figure against the batch token budget, estimated, when `check`
        would pass it (`count_tokens` off): its model is served and it is within the
        bounds; the plain shape sets none of the fields the other checks read
        (app/schemas/plain_line.py). None: the full check decides, and names what is wrong."""
        model, _ = model_and_counter(self._models, body.model, memo)
        if model is None:
            return None
        try:
            check_bounds(body, self._settings)
        except LlmqError:
            return None
        prompt = estimate_chat_tokens(body.messages, None)
        return line_tokens(body, prompt, model.max_model_len, self._settings.max_tokens_limit)

    def _check_prompt_length(self, req: ChatCompletionV2Request, model: ServedModel) -> None:
        """Where the model's context length is known and its tokenizer is reachable from here;
        otherwise the worker, which renders every prompt, applies the same rule."""
        if model.max_model_len is None or req.chat_template is not None:
            return
        count = self._models.prompt_counter(model)
        if count is not None:
            completion_budget(req, count(req), model.max_model_len)


class Bounded(Protocol):
    """The fields `check_bounds` reads (a full chat request, or a plain batch line's body)."""

    @property
    def n(self) -> int | None: ...

    @property
    def max_completion_tokens(self) -> int | None: ...

    @property
    def messages(self) -> Sequence[object]: ...

    @property
    def stop(self) -> str | list[str] | None: ...

    def completion_limit(self) -> int | None: ...


def check_bounds(req: Bounded, settings: Settings) -> None:
    """Raises InvalidRequest naming the field over a deployment bound (`n`, the completion
    tokens asked for, messages, stop sequences)."""
    s = settings
    if req.n is not None and req.n > s.max_n:
        raise InvalidRequest(f"`n` is {req.n}; the limit is {s.max_n}", param="n")
    limit = req.completion_limit()
    if limit is not None and limit > s.max_tokens_limit:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise InvalidRequest(f"`{field}` is {limit}; the limit is {s.max_tokens_limit}", param=field)
    if len(req.messages) > s.max_messages:
        raise InvalidRequest(f"{len(req.messages)} messages; the limit is {s.max_messages}", param="messages")
    if isinstance(req.stop, list) and len(req.stop) > s.max_stop_sequences:
        raise InvalidRequest(
            f"`stop` has {len(req.stop)} sequences; the limit is {s.max_stop_sequences}", param="stop"
        )


def check_output(
    req: ChatCompletionV2Request | CompletionRequest,
    plan: ToolPlan,
    settings: Settings,
    limits: ConstraintLimits,
    constraints: ConstraintChecker | None,
) -> None:
    """A request's output constraint (`guided_*`, `response_format`, tools), within the
    limits and compiled by the sandbox before anything is queued; the backend is the
    engine's."""
    found = constraint_of(req, plan)
    backend = req.guided_decoding_backend
    if backend is not None and backend != settings.structured_output_backend:
        raise Unsupported(
            f"`guided_decoding_backend` {backend!r}: this engine runs "
            f"{settings.structured_output_backend!r} for every request (vLLM 0.32 sets the backend "
            "per engine); leave it out or send that value",
            param="guided_decoding_backend",
        )
    if found is not None:
        check_limits(found, plan, limits)
        if constraints is not None:
            constraints.check(found)


def check_logit_bias(bias: dict[str, float] | None, vocab: int | None) -> None:
    """Raises InvalidRequest when a key is not a token id of the vocabulary (`vocab`
    tokens, when known) or a value is outside -100..100."""
    for token, value in (bias or {}).items():
        if not token.lstrip("-").isdigit() or int(token) < 0:
            raise InvalidRequest(f"`logit_bias` keys are token ids; got {token!r}", param="logit_bias")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise InvalidRequest("`logit_bias` values must be between -100 and 100", param="logit_bias")
    if vocab is not None:
        outside = [int(t) for t in bias or {} if int(t) >= vocab]
        if outside:
            raise InvalidRequest(
                f"`logit_bias` has token ids outside the vocabulary ({vocab} tokens): {outside[:8]}",
                param="logit_bias",
            )


def check_token_ids(ids: list[int] | None, vocab: int | None, param: str) -> None:
    """Raises InvalidRequest naming `param` when a token id is negative or, with the
    vocabulary size known, outside it."""
    outside = [t for t in ids or [] if t < 0 or (vocab is not None and t >= vocab)]
    if outside:
        raise InvalidRequest(
            f"`{param}` has token ids outside the vocabulary"
            f"{f' ({vocab} tokens)' if vocab is not None else ''}: {outside[:8]}",
            param=param,
        )


def model_not_found(name: str, served: frozenset[str]) -> NotFound:
    listed = sorted(served)
    shown = ", ".join(listed[:MODELS_LISTED])
    if len(listed) > MODELS_LISTED:
        shown += f" and {len(listed) - MODELS_LISTED} more"
    return NotFound(
        f"The model `{name}` does not exist or is not served here; "
        + (f"served: {shown}" if listed else "no model is served now"),
        param="model",
        code="model_not_found",
    )


def _template_refused(param: str) -> Unsupported:
    return Unsupported(
        f"`{param}` is refused by this deployment (LLMQ_ALLOW_CUSTOM_CHAT_TEMPLATE is "
        "off): user templates have been a sandbox-escape and resource-bomb route",
        param=param,
    )


def unsafe_url_reason(url: str, resolve: Resolver | None = None) -> str | None:
    """Why fetching `url` would be unsafe (SSRF), or None: the host is parsed as a fetcher
    would and names are resolved (`resolve`, default the system's, 2 s), see
    `app.services.addresses`."""
    return url_refusal(url, resolve or system_resolver(2.0))
