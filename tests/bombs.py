"""Structured-output constraints that crash the structured-output library (issue 9): used by
the unit, API and integration tests."""

from __future__ import annotations

from typing import Any


def ref_chain_schema(steps: int = 1000) -> dict[str, Any]:
    """A JSON schema whose root follows `steps` `$ref`s, each inside an object (~94 KB at
    1,000 steps): llguidance's `validate_grammar` segfaults on it."""
    defs: dict[str, Any] = {
        f"n{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/n{i + 1}"}}, "required": ["a"]}
        for i in range(steps)
    }
    defs[f"n{steps}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/n0"}


def chained_grammar(rules: int = 20_000) -> str:
    """A Lark grammar of `rules` rules, each the next one: segfaults llguidance too."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "x"'])
