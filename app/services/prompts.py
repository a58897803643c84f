"""Chat messages → prompt token ids through the model's own chat template.

Transformers renders templates in an immutable sandboxed Jinja environment. The worker
renders every prompt; the API may use the same renderer to count prompt tokens.
"""

from __future__ import annotations

from typing import Any

from app.schemas.chat import ChatCompletionV2Request, TextPart

# Roles most chat templates know; `developer` is OpenAI's newer name for `system`.
_ROLE_ALIASES = {"developer": "system"}


def message_text(content: Any) -> str | None:
    """A message's text: the string itself, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.text for p in content if isinstance(p, TextPart))


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
        out.append(entry)
    return out


class ChatRenderer:
    """Wraps a Hugging Face tokenizer (anything with `apply_chat_template` and `encode`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model: str) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model))

    def render_text(self, req: ChatCompletionV2Request) -> str:
        continue_final = bool(req.continue_final_message)
        add_generation = (
            req.add_generation_prompt if req.add_generation_prompt is not None else not continue_final
        )
        text = self.tokenizer.apply_chat_template(
            to_template_messages(req),
            tokenize=False,
            add_generation_prompt=add_generation,
            continue_final_message=continue_final,
        )
        return str(text)

    def render(self, req: ChatCompletionV2Request) -> list[int]:
        text = self.render_text(req)
        return list(self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))
