"""Launch's and OpenAI's structured-output fields → the one constraint the engine enforces
(vLLM 0.32 `StructuredOutputsParams`: json, regex, choice, grammar or json_object).

Legacy names are translated, never dropped: `guided_json` → json, `guided_regex` → regex,
`guided_choice` → choice, `guided_grammar` → grammar, `response_format` json_object /
json_schema → json_object / json, and a named or required tool choice → the schema of its
arguments.
"""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request, ResponseFormatJsonObject, ResponseFormatJsonSchema
from app.services.tools import ToolPlan


def constraint(req: ChatCompletionV2Request, plan: ToolPlan) -> dict[str, Any] | None:
    """The structured-outputs keyword arguments, or None for free text.

    Raises:
        InvalidRequest: more than one constraint, or a json_schema without a schema.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if req.guided_json is not None:
        found.append(("guided_json", {"json": req.guided_json}))
    if req.guided_regex is not None:
        found.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise InvalidRequest("`guided_choice` needs at least one choice", param="guided_choice")
        found.append(("guided_choice", {"choice": list(req.guided_choice)}))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", {"grammar": req.guided_grammar}))
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        found.append(("response_format", {"json_object": True}))
    elif isinstance(fmt, ResponseFormatJsonSchema):
        if fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                "`response_format.json_schema.schema` is required", param="response_format.json_schema.schema"
            )
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    tool_schema = plan.schema()
    if tool_schema is not None:
        found.append(("tool_choice", {"json": tool_schema}))
    if len(found) > 1:
        names = ", ".join(f"`{name}`" for name, _ in found)
        raise InvalidRequest(
            f"only one output constraint can apply to a request; this one sets {names}", param=found[1][0]
        )
    return found[0][1] if found else None
