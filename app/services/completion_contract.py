"""Which text completion fields this deployment honours, and the bounds it enforces: the
`/v1/completions` counterpart of app/services/contract.py, with the same rules where the
two requests share a field (the same bounds, vocabulary checks and output constraints).

Nothing is accepted and ignored: a field is honoured, set to its neutral value, or refused
with a 400 naming it and saying why (what vLLM 0.32's completions path does not do).
"""

from __future__ import annotations

from app.domain.budget import completion_budget, estimate_prompt_tokens, line_tokens
from app.domain.metadata import check_metadata
from app.domain.structured import ConstraintLimits
from app.domain.tools import ToolPlan
from app.errors import InvalidRequest, LlmqError, Unsupported
from app.schemas.text_completion import CompletionRequest
from app.services.contract import (
    ConstraintChecker,
    CounterMemo,
    ModelCatalog,
    check_logit_bias,
    check_output,
    check_token_ids,
    model_and_counter,
    model_not_found,
)
from app.services.models import ServedModel
from app.settings import Settings

NO_TOOLS = ToolPlan("none")

# Fields not honoured, with the value that asks for nothing.
NEUTRAL = {"use_beam_search": False, "length_penalty": 1.0}

REFUSED: dict[str, str] = {
    # vLLM's OpenAI server answers "suffix is not currently supported" (serving_completion).
    "suffix": "llmq builds no fill-in-the-middle prompt (vLLM's server offers `suffix` only for "
    "models with their own FIM rendering)",
    "use_beam_search": "beam search is not available through vLLM 0.32's AsyncLLM",
    "length_penalty": "it applies to beam search, which vLLM 0.32's AsyncLLM does not offer",
    "guided_whitespace_pattern": "vLLM 0.32 ignores a per-request whitespace pattern; whitespace in "
    "JSON output is set for the whole engine (none between tokens)",
}


class CompletionPolicy:
    """Checks a parsed `CompletionRequest` against what this deployment runs."""

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

    def check(self, req: CompletionRequest, *, streaming: bool = False, count_tokens: bool = True) -> None:
        """`streaming`: the endpoint can answer `stream: true`. `count_tokens`: off for
        batch lines, where a prompt over the context fails its own line.

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
                "`stream: true` is for /v1/completions itself; a batch line cannot stream", param="stream"
            )
        if req.stream_options is not None and not req.stream:
            raise InvalidRequest(
                "`stream_options` is only allowed when `stream` is true", param="stream_options"
            )
        self._check_fields(req)
        check_metadata(req.metadata)
        self._check_prompt(req, model.vocab_size)
        self._check_sampling(req, model.vocab_size)
        self._check_output(req)
        self._check_bounds(req)
        if count_tokens:
            self._check_prompt_length(req, model)

    @staticmethod
    def _check_fields(req: CompletionRequest) -> None:
        for name, why in REFUSED.items():
            value = getattr(req, name)
            if value is None or (name in NEUTRAL and value == NEUTRAL[name]):
                continue
            raise Unsupported(f"`{name}` is not supported: {why}", param=name)

    @staticmethod
    def _check_prompt(req: CompletionRequest, vocab: int | None) -> None:
        try:
            prompt = req.single_prompt()
        except ValueError as exc:
            raise Unsupported(
                f"`prompt` holds {exc}: send one prompt per request (a string or token ids), "
                "or several requests as a batch",
                param="prompt",
            ) from exc
        if not prompt:
            raise InvalidRequest("`prompt` is empty", param="prompt")
        if isinstance(prompt, list):
            check_token_ids(prompt, vocab, "prompt")

    def _check_sampling(self, req: CompletionRequest, vocab: int | None) -> None:
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise Unsupported(
                f"`best_of` {req.best_of} with `n` {n}: vLLM 0.32 generates exactly `n` sequences "
                "(best_of was removed); send best_of equal to n or leave it out",
                param="best_of",
            )
        check_logit_bias(req.logit_bias, vocab)
        check_token_ids(req.stop_token_ids, vocab, "stop_token_ids")
        if req.min_tokens is not None and req.min_tokens > req.completion_limit():
            raise InvalidRequest("`min_tokens` is above `max_tokens`", param="min_tokens")

    def _check_output(self, req: CompletionRequest) -> None:
        check_output(req, NO_TOOLS, self._settings, self._limits, self._constraints)

    def _check_bounds(self, req: CompletionRequest) -> None:
        s = self._settings
        if req.n is not None and req.n > s.max_n:
            raise InvalidRequest(f"`n` is {req.n}; the limit is {s.max_n}", param="n")
        if req.completion_limit() > s.max_tokens_limit:
            raise InvalidRequest(
                f"`max_tokens` is {req.completion_limit()}; the limit is {s.max_tokens_limit}",
                param="max_tokens",
            )
        if isinstance(req.stop, list) and len(req.stop) > s.max_stop_sequences:
            raise InvalidRequest(
                f"`stop` has {len(req.stop)} sequences; the limit is {s.max_stop_sequences}", param="stop"
            )

    def _check_prompt_length(self, req: CompletionRequest, model: ServedModel) -> None:
        """Where the context length is known and the tokenizer reachable from here;
        otherwise the worker, which encodes every prompt, applies the same rule."""
        if model.max_model_len is None:
            return
        single = req.single_prompt()
        if isinstance(single, list):
            completion_budget(req, len(single), model.max_model_len)
            return
        count = self._models.prompt_counter(model)
        if count is not None:
            completion_budget(req, count(req), model.max_model_len)

    def budget_tokens(
        self, req: CompletionRequest, memo: CounterMemo | None = None, *, exact: bool = True
    ) -> int:
        """A batch line's figure against the batch token budget (app/domain/budget.py's
        `line_tokens`): the model's own prompt count when `exact` and this API has its
        tokenizer, else the estimate. `memo`: one upload's lookups (`model_and_counter`)."""
        model, count = model_and_counter(self._models, req.model, memo)
        prompt: int | None = None
        if exact and count is not None:
            try:
                prompt = count(req)
            except LlmqError:
                prompt = None  # a line that cannot be encoded fails on its own when it runs
        if prompt is None:
            prompt = estimate_prompt_tokens(req)
        context = model.max_model_len if model is not None else None
        return line_tokens(req, prompt, context, self._settings.max_tokens_limit)
