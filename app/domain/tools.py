"""Tool calling on any model: `tool_choice` named or `required` constrain the output to the
function's parameter schema (structured outputs); `auto` needs a configured vLLM tool
parser. Legacy `functions` / `function_call` map onto the same plan and answer with
`message.function_call`. Engine-agnostic: used by the API's checks and the worker.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from app.errors import InvalidRequest, Unsupported
from app.schemas.chat import ChatCompletionV2Request, NamedToolChoice

Mode = Literal["none", "named", "required", "auto"]

_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    name: str | None = None  # the function, when named
    legacy: bool = False  # answer with message.function_call (functions API)
    parallel: bool = True
    definitions: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool objects

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is held to, or None (free text)."""
        if self.mode not in ("named", "required"):
            return None
        params = {d["function"]["name"]: d["function"].get("parameters") or _OBJECT for d in self.definitions}
        if self.mode == "named" and self.name is not None:
            return params[self.name]
        if self.mode == "required":
            items = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, schema in params.items()
                ]
            }
            array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return array
        return None


def plan_tools(req: ChatCompletionV2Request, *, auto_parser: str | None) -> ToolPlan:
    """Raises:
    InvalidRequest: a named function that is not among the tools, tools and functions together.
    Unsupported: `auto` (the default when tools are given) with no tool parser configured.
    """
    if not req.tools and not req.functions and req.tool_choice is None and req.function_call is None:
        return _NO_TOOLS
    if req.tools and req.functions:
        raise InvalidRequest("send `tools` or the legacy `functions`, not both", param="functions")
    legacy = bool(req.functions) or req.function_call is not None
    definitions: list[dict[str, Any]]
    if legacy:
        definitions = [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions or []
        ]
        choice: Any = req.function_call
        param = "function_call"
    else:
        definitions = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        param = "tool_choice"
    names = [d["function"]["name"] for d in definitions]
    if choice is None:
        choice = "auto" if definitions else "none"
    if choice == "none":
        return ToolPlan("none", legacy=legacy, definitions=definitions)
    if not definitions:
        raise InvalidRequest(f"`{param}` asks for a tool call but no tools were given", param=param)
    parallel = req.parallel_tool_calls is not False
    if choice == "required":
        return ToolPlan("required", legacy=legacy, parallel=parallel and not legacy, definitions=definitions)
    if choice == "auto":
        if not auto_parser:
            raise Unsupported(
                f"`{param}: auto` (the default when tools are given) needs a tool-call parser for the served "
                "model, and this deployment has none configured (LLMQ_TOOL_CALL_PARSER); send "
                f"`{param}` as 'required', 'none' or a named function",
                param=param,
            )
        return ToolPlan("auto", legacy=legacy, parallel=parallel, definitions=definitions)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
    if name not in names:
        raise InvalidRequest(f"`{param}` names `{name}`, which is not among the tools given", param=param)
    return ToolPlan("named", name=name, legacy=legacy, parallel=False, definitions=definitions)


_NO_TOOLS = ToolPlan("none")


def call_id(job_id: str, choice: int, k: int) -> str:
    """Deterministic, so the streamed and the stored tool call carry the same id."""
    return "call_" + hashlib.sha256(f"{job_id}:{choice}:{k}".encode()).hexdigest()[:24]


def parse_constrained(plan: ToolPlan, text: str, job_id: str, choice: int) -> list[dict[str, Any]] | None:
    """Tool calls from output held to `plan.schema()`; None when the text is not complete
    JSON (the generation was cut by `max_tokens`)."""
    if plan.mode == "named" and plan.name is not None:
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(call_id(job_id, choice, 0), plan.name, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return None
        return [
            _call(
                call_id(job_id, choice, k), item["name"], json.dumps(item["parameters"], ensure_ascii=False)
            )
            for k, item in enumerate(items)
        ]
    return None


def _call(call: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call, "type": "function", "function": {"name": name, "arguments": arguments}}
