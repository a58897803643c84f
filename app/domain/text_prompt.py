"""A text completion's prompt → token ids: one rule for the API (counting, before queuing)
and the worker (what the engine runs). No chat template: the text is encoded as vLLM's
completions server encodes it, special tokens added unless `add_special_tokens` is false."""

from __future__ import annotations

from typing import Protocol

from app.errors import InvalidRequest
from app.schemas.text_completion import CompletionRequest


class Encoder(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def prompt_ids(req: CompletionRequest, encoder: Encoder) -> list[int]:
    """The prompt's token ids: as given, or the text encoded.

    Raises:
        InvalidRequest: the prompt is not one prompt, or encodes to nothing.
    """
    try:
        prompt = req.single_prompt()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="prompt") from exc
    if isinstance(prompt, list):
        return prompt
    ids = encoder.encode(prompt, add_special_tokens=req.add_special_tokens is not False)
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
    return ids


def echo_text(req: CompletionRequest, prompt: list[int], encoder: Encoder) -> str:
    """With `echo`, each choice's text starts with the prompt (decoded when given as ids)."""
    if not req.echo:
        return ""
    single = req.single_prompt()
    return single if isinstance(single, str) else encoder.decode(prompt)
