"""Chat messages → prompt token ids through the model's chat template.

Transformers renders templates in an immutable sandboxed Jinja environment. The model's own
template over a bounded request runs in-process; anything with user input in the template
(a user `chat_template`, allowed only when the operator turns it on; user
`chat_template_kwargs`; a large request) runs in a sandbox process (template_sandbox.py) with a
time limit, an address-space limit and an output cap, and is killed when it overruns, so a
template bomb costs one request, not the worker or an API process. The worker renders every
prompt; the API uses the same renderer to count tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.domain.tools import ToolPlan
from app.errors import InvalidRequest
from app.schemas.chat import AssistantMessage, ChatCompletionV2Request, FunctionMessage, TextPart, ToolMessage
from app.services.template_sandbox import SandboxJob, TemplateSandbox

__all__ = ["ChatRenderer", "TemplateCall", "TemplateSandbox", "message_text", "template_call"]

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
    """Wraps a Hugging Face tokenizer (anything with `apply_chat_template` and `encode`).

    The model's own template with no user `chat_template_kwargs`, over a request of at most
    `inprocess_max_bytes`, renders in-process: it is trusted and its cost is bounded by the
    size. Every other render (a user `chat_template`, user kwargs, a large request) goes to
    the sandbox, with a time limit, when there is one."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        sandbox: TemplateSandbox | None = None,
        custom_templates: bool | None = None,
        inprocess_max_bytes: int = 64 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self._sandbox = sandbox
        self._custom = sandbox is not None if custom_templates is None else custom_templates
        self._inprocess_max = inprocess_max_bytes

    @classmethod
    def load(
        cls,
        model: str,
        *,
        sandbox: TemplateSandbox | None = None,
        custom_templates: bool | None = None,
        inprocess_max_bytes: int = 64 * 1024,
    ) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(
            AutoTokenizer.from_pretrained(model),
            sandbox=sandbox,
            custom_templates=custom_templates,
            inprocess_max_bytes=inprocess_max_bytes,
        )

    def close(self) -> None:
        """Stop the sandbox processes (the renderer is dropped)."""
        if self._sandbox is not None:
            self._sandbox.close()

    def _sandbox_param(self, req: ChatCompletionV2Request, call: TemplateCall) -> str | None:
        """The field whose input sends this render to the sandbox, or None (in-process)."""
        if req.chat_template is not None:
            return "chat_template"
        if req.chat_template_kwargs:
            return "chat_template_kwargs"
        size = len(json.dumps(call.messages, separators=(",", ":")))
        size += sum(len(json.dumps(call.kwargs.get(k) or [])) for k in ("tools", "documents"))
        return "messages" if size > self._inprocess_max else None

    def render_text(self, req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> str:
        """The prompt as text, rendered in-process (for callers that trust the request)."""
        call = template_call(req, plan)
        if req.chat_template is not None:
            raise InvalidRequest("custom chat templates are not rendered here", param="chat_template")
        return self._apply(call)

    def _apply(self, call: TemplateCall) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(call.messages, tokenize=False, **call.kwargs))
        except Exception as exc:
            raise InvalidRequest(f"the chat template refused the messages: {exc}", param="messages") from exc

    def render(self, req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> list[int]:
        """Prompt token ids.

        Raises:
            InvalidRequest: the template refused the request or overran its time limit.
        """
        call = template_call(req, plan)
        add_special = bool(req.add_special_tokens)
        if req.chat_template is not None and not (self._custom and self._sandbox is not None):
            raise InvalidRequest("custom chat templates are not enabled", param="chat_template")
        param = self._sandbox_param(req, call)
        if param is not None and self._sandbox is not None:
            job = SandboxJob(req.chat_template, call.messages, call.kwargs, add_special)
            return self._sandbox.render(job, param=param)
        return list(self.tokenizer.encode(self._apply(call), add_special_tokens=add_special))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """A text completion's prompt ids: the text as the tokenizer reads it, no template."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (a token-id prompt, echoed)."""
        return str(self.tokenizer.decode(token_ids))
