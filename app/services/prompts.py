"""Chat messages → prompt token ids through the model's chat template.

Transformers renders templates in an immutable sandboxed Jinja environment. The model's own
template runs in-process; a user-supplied `chat_template` (allowed only when the operator
turns it on) runs in a separate process with a time limit, an address-space limit and an
output cap, and is killed when it overruns, so a template bomb costs one request, not the
worker. The worker renders every prompt; the API uses the same renderer to count tokens.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.pool
import threading
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidRequest
from app.schemas.chat import AssistantMessage, ChatCompletionV2Request, FunctionMessage, TextPart, ToolMessage
from app.services.tools import ToolPlan

# OpenAI's newer name for `system`; most chat templates only know `system`.
_ROLE_ALIASES = {"developer": "system"}


def message_text(content: Any) -> str | None:
    """A message's text: the string itself, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.text for p in content if isinstance(p, TextPart))


def _arguments(raw: str) -> Any:
    """Templates expect tool-call arguments as a mapping (`tool_call.arguments | tojson`)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def to_template_messages(req: ChatCompletionV2Request) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        entry: dict[str, Any] = {
            "role": _ROLE_ALIASES.get(msg.role, msg.role),
            "content": message_text(getattr(msg, "content", None)) or "",
        }
        name = getattr(msg, "name", None)
        if name:
            entry["name"] = name
        if isinstance(msg, AssistantMessage):
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in msg.tool_calls or []
            ]
            if msg.function_call is not None:
                calls.append(
                    {
                        "type": "function",
                        "function": {
                            "name": msg.function_call.name,
                            "arguments": _arguments(msg.function_call.arguments),
                        },
                    }
                )
            if calls:
                entry["tool_calls"] = calls
        elif isinstance(msg, ToolMessage):
            entry["tool_call_id"] = msg.tool_call_id
        elif isinstance(msg, FunctionMessage):
            entry["role"] = "tool"
        out.append(entry)
    return out


@dataclass(frozen=True)
class TemplateCall:
    """Everything `apply_chat_template` gets, picklable for the sandbox process."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]


def template_call(req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> TemplateCall:
    continue_final = bool(req.continue_final_message)
    add_generation = (
        req.add_generation_prompt if req.add_generation_prompt is not None else not continue_final
    )
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    kwargs.update(
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
    )
    if plan is not None and plan.definitions:
        kwargs["tools"] = plan.definitions
    if req.documents:
        kwargs["documents"] = req.documents
    return TemplateCall(to_template_messages(req), kwargs)


class ChatRenderer:
    """Wraps a Hugging Face tokenizer (anything with `apply_chat_template` and `encode`)."""

    def __init__(self, tokenizer: Any, *, sandbox: TemplateSandbox | None = None) -> None:
        self.tokenizer = tokenizer
        self._sandbox = sandbox

    @classmethod
    def load(cls, model: str, *, sandbox: TemplateSandbox | None = None) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model), sandbox=sandbox)

    def render_text(self, req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> str:
        call = template_call(req, plan)
        if req.chat_template is not None:
            if self._sandbox is None:
                raise InvalidRequest("custom chat templates are not enabled", param="chat_template")
            return self._sandbox.render(req.chat_template, call)
        try:
            return str(self.tokenizer.apply_chat_template(call.messages, tokenize=False, **call.kwargs))
        except Exception as exc:
            raise InvalidRequest(f"the chat template refused the messages: {exc}", param="messages") from exc

    def render(self, req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> list[int]:
        text = self.render_text(req, plan)
        return list(self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))


# --- the sandbox process -----------------------------------------------------------------

_tokenizer: Any = None


def _sandbox_init(model: str, memory_bytes: int) -> None:
    import resource

    global _tokenizer
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from transformers import AutoTokenizer

    _tokenizer = AutoTokenizer.from_pretrained(model)


def _sandbox_ping() -> bool:
    return _tokenizer is not None


def _sandbox_render(template: str, call: TemplateCall, max_output: int) -> str:
    text = str(
        _tokenizer.apply_chat_template(call.messages, chat_template=template, tokenize=False, **call.kwargs)
    )
    if len(text) > max_output:
        raise ValueError(f"rendered prompt is over {max_output} characters")
    return text


class TemplateSandbox:
    """Renders user templates in a child process; one that overruns its time is killed."""

    def __init__(self, model: str, *, timeout: float, max_output: int, memory_bytes: int = 2 * 2**30) -> None:
        self._model = model
        self._timeout = timeout
        self._max_output = max_output
        self._memory = memory_bytes
        self._pool: multiprocessing.pool.Pool | None = None
        self._lock = threading.Lock()

    def _get_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(1, initializer=_sandbox_init, initargs=(self._model, self._memory))
            # Start-up (importing transformers) is not the template's time.
            pool.apply_async(_sandbox_ping).get(120)
            self._pool = pool
        return self._pool

    def render(self, template: str, call: TemplateCall) -> str:
        """Raises:
        InvalidRequest: the template failed, overran its time, or rendered too much.
        """
        with self._lock:  # one render at a time: a killed pool must not take others with it
            pool = self._get_pool()
            pending = pool.apply_async(_sandbox_render, (template, call, self._max_output))
            try:
                return str(pending.get(self._timeout))
            except multiprocessing.TimeoutError as exc:
                pool.terminate()
                self._pool = None
                raise InvalidRequest(
                    f"`chat_template` did not finish rendering within {self._timeout:g} s",
                    param="chat_template",
                ) from exc
            except Exception as exc:
                raise InvalidRequest(f"`chat_template` failed: {exc}", param="chat_template") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
