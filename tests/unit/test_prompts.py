from __future__ import annotations

from typing import Any

import pytest

from app.domain.prompts import ChatRenderer, to_template_messages
from app.domain.tools import plan_tools
from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request


class RecordingTokenizer:
    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
        self.encoded: list[tuple[str, bool]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.calls.append((messages, kwargs))
        return "PROMPT"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.encoded.append((text, add_special_tokens))
        return [1, 2, 3]


def req(**fields: Any) -> ChatCompletionV2Request:
    return ChatCompletionV2Request.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_template_options_reach_the_template() -> None:
    tok = RecordingTokenizer()
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = req(
        documents=[{"title": "t", "text": "d"}],
        chat_template_kwargs={"enable_thinking": True},
        add_special_tokens=True,
        tools=tools,
        tool_choice="none",
    )
    assert ChatRenderer(tok).render(r, plan_tools(r, auto_parser=None)) == [1, 2, 3]
    ((_, kwargs),) = tok.calls
    assert kwargs["documents"] == [{"title": "t", "text": "d"}]
    assert kwargs["enable_thinking"] is True
    assert kwargs["tools"] == tools
    assert kwargs["add_generation_prompt"] is True and kwargs["continue_final_message"] is False
    assert kwargs["tokenize"] is False
    assert tok.encoded == [("PROMPT", True)]


def test_continue_final_message_drops_the_generation_prompt() -> None:
    tok = RecordingTokenizer()
    ChatRenderer(tok).render(req(continue_final_message=True))
    ((_, kwargs),) = tok.calls
    assert kwargs["continue_final_message"] is True and kwargs["add_generation_prompt"] is False


def test_messages_of_every_role_become_template_messages() -> None:
    r = ChatCompletionV2Request.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "hi", "name": "ann"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "function", "name": "f", "content": "43"},
            ],
        }
    )
    out = to_template_messages(r)
    assert [m["role"] for m in out] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert out[1]["content"] == "a\nb" and out[2]["name"] == "ann"
    assert out[3]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[4]["tool_call_id"] == "c1"


def test_custom_template_without_sandbox_is_refused() -> None:
    with pytest.raises(InvalidRequest) as exc:
        ChatRenderer(RecordingTokenizer()).render(req(chat_template="{{ x }}"))
    assert exc.value.param == "chat_template"


def test_template_errors_are_the_requests_fault() -> None:
    class Refusing(RecordingTokenizer):
        def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
            raise ValueError("Conversation roles must alternate")

    with pytest.raises(InvalidRequest) as exc:
        ChatRenderer(Refusing()).render(req())
    assert "alternate" in exc.value.message and exc.value.param == "messages"
