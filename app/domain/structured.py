"""Launch's and OpenAI's structured-output fields → the one constraint the engine enforces
(vLLM 0.32 `StructuredOutputsParams`: json, regex, choice, grammar or json_object).

Legacy names are translated, never dropped: `guided_json` → json, `guided_regex` → regex,
`guided_choice` → choice, `guided_grammar` → grammar, `response_format` json_object /
json_schema → json_object / json, and a named or required tool choice → the schema of its
arguments.

Regexes (`guided_regex`, and `pattern`/`patternProperties` in schemas) are rewritten so
`\\d \\w \\s` and their negations mean the ASCII classes (ECMA-262's `\\d`), whatever the
backend's regex engine would make of them: a user asking for a date wants ASCII digits.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from app.domain.tools import ToolPlan
from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request, ResponseFormatJsonObject, ResponseFormatJsonSchema
from app.schemas.text_completion import CompletionRequest
from app.settings import Settings


@dataclass(frozen=True)
class Constraint:
    """The structured-outputs keyword arguments (rewritten for the engine), the request
    field they came from, and a hash of the constraint as the request sent it."""

    param: str
    kwargs: dict[str, Any]
    digest: str = ""

    def key(self, backend: str) -> str:
        """A hash of (backend, constraint): what a compile verdict is cached under."""
        digest = self.digest or _digest(self.kwargs)
        return hashlib.sha256(f"{backend}\0{digest}".encode()).hexdigest()


K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A small thread-safe LRU map: per-process caches keyed by a constraint's hash, so a
    batch whose lines share one schema pays for it once."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def drop(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)


def _digest(kwargs: dict[str, Any]) -> str:
    text = json.dumps(kwargs, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# The ASCII rewrite of a constraint, by its digest (the rewrite walks the whole schema).
_REWRITTEN: Lru[str, dict[str, Any]] = Lru(1024)
# Bound verdicts (None: within bounds), by (digest, field, limits).
_WITHIN: Lru[tuple[str, str, ConstraintLimits], tuple[str, str]] = Lru(1024)


def constraint(req: ChatCompletionV2Request, plan: ToolPlan) -> dict[str, Any] | None:
    """The structured-outputs keyword arguments, or None for free text.

    Raises:
        InvalidRequest: more than one constraint, a json_schema without a schema, or a
        regex whose ASCII rewrite is impossible.
    """
    found = constraint_of(req, plan)
    return found.kwargs if found is not None else None


def constraint_of(req: ChatCompletionV2Request | CompletionRequest, plan: ToolPlan) -> Constraint | None:
    """`constraint`, with the field it came from (for errors that name it)."""
    # (field for the "only one" error, field a problem with it is reported on, kwargs)
    found: list[tuple[str, str, dict[str, Any]]] = []
    if req.guided_json is not None:
        found.append(("guided_json", "guided_json", {"json": req.guided_json}))
    if req.guided_regex is not None:
        found.append(("guided_regex", "guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise InvalidRequest("`guided_choice` needs at least one choice", param="guided_choice")
        found.append(("guided_choice", "guided_choice", {"choice": list(req.guided_choice)}))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", "guided_grammar", {"grammar": req.guided_grammar}))
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        found.append(("response_format", "response_format", {"json_object": True}))
    elif isinstance(fmt, ResponseFormatJsonSchema):
        if fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                "`response_format.json_schema.schema` is required", param="response_format.json_schema.schema"
            )
        found.append(
            ("response_format", "response_format.json_schema.schema", {"json": fmt.json_schema.schema_})
        )
    tool_schema = plan.schema()
    if tool_schema is not None:
        found.append(("tool_choice", _tool_param(plan), {"json": tool_schema}))
    if len(found) > 1:
        names = ", ".join(f"`{name}`" for name, _, _ in found)
        raise InvalidRequest(
            f"only one output constraint can apply to a request; this one sets {names}", param=found[1][0]
        )
    if not found:
        return None
    _, param, kwargs = found[0]
    digest = _digest(kwargs)
    rewritten = _REWRITTEN.get(digest)
    if rewritten is None:
        rewritten = kwargs
        if "regex" in kwargs:
            rewritten = {"regex": ascii_classes(kwargs["regex"], param)}
        elif "json" in kwargs:
            rewritten = {"json": ascii_schema_patterns(kwargs["json"], param)}
        _REWRITTEN.put(digest, rewritten)
    return Constraint(param, rewritten, digest)


def _tool_param(plan: ToolPlan) -> str:
    """The field a tool-choice constraint names: the named tool's parameters, else the tools."""
    prefix = "functions" if plan.legacy else "tools"
    if plan.mode == "named":
        for i, d in enumerate(plan.definitions):
            if d["function"]["name"] == plan.name:
                return f"functions[{i}].parameters" if plan.legacy else f"tools[{i}].function.parameters"
    return prefix


def tool_parameters(plan: ToolPlan) -> list[tuple[str, Any]]:
    """(field, schema) of each tool whose parameters constrain the output."""
    if plan.schema() is None:
        return []
    return [
        (
            f"functions[{i}].parameters" if plan.legacy else f"tools[{i}].function.parameters",
            d["function"].get("parameters"),
        )
        for i, d in enumerate(plan.definitions)
        if plan.mode == "required" or d["function"]["name"] == plan.name
    ]


# --- bounds ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstraintLimits:
    """What a constraint may cost to compile (each a `Settings` field)."""

    max_schema_bytes: int
    max_schema_refs: int
    max_schema_ref_depth: int
    max_grammar_rules: int
    max_regex_length: int
    max_choices: int
    max_choice_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> ConstraintLimits:
        return cls(
            max_schema_bytes=settings.max_schema_bytes,
            max_schema_refs=settings.max_schema_refs,
            max_schema_ref_depth=settings.max_schema_ref_depth,
            max_grammar_rules=settings.max_grammar_rules,
            max_regex_length=settings.max_regex_length,
            max_choices=settings.max_choices,
            max_choice_bytes=settings.max_choice_bytes,
        )


# A rule definition in a Lark (`name: ...`) or GBNF/EBNF (`name ::= ...`) grammar.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.\-]*(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)

# Keywords whose values are data, not schemas: their `pattern` keys are not regexes.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def check_limits(found: Constraint, plan: ToolPlan, limits: ConstraintLimits) -> None:
    """Raises InvalidRequest, naming the field and the bound, when a constraint is over one."""
    key = (found.digest, found.param, limits)
    verdict = _WITHIN.get(key) if found.digest else None
    if verdict is None:
        try:
            _check_limits(found, plan, limits)
            verdict = ("", "")
        except InvalidRequest as exc:
            verdict = (exc.message, exc.param or found.param)
        if found.digest:
            _WITHIN.put(key, verdict)
    if verdict[0]:
        raise InvalidRequest(verdict[0], param=verdict[1])


def _check_limits(found: Constraint, plan: ToolPlan, limits: ConstraintLimits) -> None:
    kw = found.kwargs
    if "regex" in kw:
        _check_regex(kw["regex"], found.param, limits)
    elif "grammar" in kw:
        grammar: str = kw["grammar"]
        size = len(grammar.encode("utf-8", "surrogatepass"))
        if size > limits.max_schema_bytes:
            raise InvalidRequest(
                f"`{found.param}` is {size} bytes; the limit is {limits.max_schema_bytes}", param=found.param
            )
        rules = len(_RULE.findall(grammar))
        if rules > limits.max_grammar_rules:
            raise InvalidRequest(
                f"`{found.param}` has {rules} rules; the limit is {limits.max_grammar_rules}",
                param=found.param,
            )
    elif "choice" in kw:
        choices: list[str] = kw["choice"]
        if len(choices) > limits.max_choices:
            raise InvalidRequest(
                f"`{found.param}` has {len(choices)} choices; the limit is {limits.max_choices}",
                param=found.param,
            )
        for i, choice in enumerate(choices):
            size = len(choice.encode("utf-8", "surrogatepass"))
            if size > limits.max_choice_bytes:
                raise InvalidRequest(
                    f"`{found.param}[{i}]` is {size} bytes; the limit is {limits.max_choice_bytes}",
                    param=f"{found.param}[{i}]",
                )
    elif "json" in kw:
        parts = tool_parameters(plan) if found.param.startswith(("tools", "functions")) else []
        for param, schema in parts or [(found.param, kw["json"])]:
            if schema is not None:
                _check_schema(schema, param, limits)


def _check_regex(regex: str, param: str, limits: ConstraintLimits, where: str = "") -> None:
    if len(regex) > limits.max_regex_length:
        raise InvalidRequest(
            f"`{param}`{where} is a regex of {len(regex)} characters; the limit is {limits.max_regex_length}",
            param=param,
        )


def _check_schema(schema: Any, param: str, limits: ConstraintLimits) -> None:
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise InvalidRequest(
            f"`{param}` is {size} bytes of JSON schema; the limit is {limits.max_schema_bytes}", param=param
        )
    refs: list[tuple[str, Any]] = []  # (ref, the node holding it)
    for node, in_data in _walk(schema):
        if in_data or not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            refs.append((ref, node))
        for key, value in _patterns(node):
            _check_regex(value, param, limits, f" has a `{key}` that")
    if len(refs) > limits.max_schema_refs:
        raise InvalidRequest(
            f"`{param}` has {len(refs)} `$ref`s; the limit is {limits.max_schema_refs}", param=param
        )
    depth = _ref_depth(schema, [r for r, _ in refs])
    if depth > limits.max_schema_ref_depth:
        raise InvalidRequest(
            f"`{param}` has a `$ref` chain {depth} deep; the limit is {limits.max_schema_ref_depth}",
            param=param,
        )


def _walk(root: Any) -> list[tuple[Any, bool]]:
    """Every node under `root` (iteratively: no recursion limit), and whether it is data."""
    out: list[tuple[Any, bool]] = []
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, in_data = stack.pop()
        out.append((node, in_data))
        if isinstance(node, dict):
            stack.extend((v, in_data or k in _DATA_KEYWORDS) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, in_data) for v in node)
    return out


def _patterns(node: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    if isinstance(node.get("pattern"), str):
        found.append(("pattern", node["pattern"]))
    props = node.get("patternProperties")
    if isinstance(props, dict):
        found.extend(("patternProperties", k) for k in props)
    return found


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` (`#/a/b`) points at, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ref_depth(root: Any, refs: list[str]) -> int:
    """The longest chain of `$ref`s followed one inside another (a cycle counts once)."""
    inner: dict[str, list[str]] = {}
    for ref in set(refs):
        target = _resolve(root, ref)
        inner[ref] = [
            n["$ref"]
            for n, data in _walk(target)
            if not data and isinstance(n, dict) and isinstance(n.get("$ref"), str)
        ]
    depth: dict[str, int] = {}
    for start in inner:
        if start in depth:
            continue
        # Iterative DFS; a node on the current path (a cycle) adds nothing.
        on_path: set[str] = {start}
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            ref, i = stack[-1]
            children = inner.get(ref, [])
            if i < len(children):
                stack[-1] = (ref, i + 1)
                child = children[i]
                if child not in depth and child not in on_path and child in inner:
                    on_path.add(child)
                    stack.append((child, 0))
                continue
            stack.pop()
            on_path.discard(ref)
            depth[ref] = 1 + max((depth.get(c, 0) for c in children), default=0)
    return max(depth.values(), default=0)


# --- ASCII classes -----------------------------------------------------------------------

_DIGIT = frozenset("0123456789")
_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_SPACE = frozenset("\t\n\v\f\r ")
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
# Each class written as members of a character class, ASCII only.
_MEMBERS = {"d": "0-9", "w": "A-Za-z0-9_", "s": "\\t\\n\\x0B\\x0C\\r "}


def _members(chars: frozenset[str] | set[str]) -> str:
    """Characters as members of a character class, each escaped."""
    return "".join(f"\\x{ord(c):02X}" if not c.isalnum() else c for c in sorted(chars))


def ascii_classes(pattern: str, param: str = "guided_regex") -> str:
    """`pattern` with `\\d \\w \\s \\D \\W \\S` replaced by their ASCII classes, inside and
    outside character classes. Other escapes (`\\\\d` is a backslash and a `d`) are kept.

    A negated escape inside a class cannot be written as class members: `[a\\D]` becomes
    the alternation `(?:[a]|[^0-9])`, and `[^a\\D]` (the digits but `a`) an explicit class.

    Raises:
        InvalidRequest: a negated class whose members leave no character to match.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in _CLASSES:
                out.append(f"[{_MEMBERS[e]}]")
            elif e.lower() in _CLASSES:
                out.append(f"[^{_MEMBERS[e.lower()]}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
        elif c == "[":
            i = _class(pattern, i, out, param)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _class(pattern: str, start: int, out: list[str], param: str) -> int:
    """Rewrite the character class at `start`; return the index after it."""
    i = start + 1
    negated = i < len(pattern) and pattern[i] == "^"
    if negated:
        i += 1
    members: list[str] = []
    complements: list[frozenset[str]] = []  # each negated escape's own class
    first = True
    while i < len(pattern):
        c = pattern[i]
        if c == "]" and not first:
            break
        first = False
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in _CLASSES:
                members.append(_MEMBERS[e])
            elif e.lower() in _CLASSES:
                complements.append(_CLASSES[e.lower()])
            else:
                members.append(pattern[i : i + 2])
            i += 2
        elif c == "[" and pattern.startswith("[:", i) and (end := pattern.find(":]", i + 2)) != -1:
            members.append(pattern[i : end + 2])  # a POSIX class, [:alpha:]
            i = end + 2
        else:
            members.append(c)
            i += 1
    else:
        # Unclosed: copy as written; the compiler names the error.
        out.append(pattern[start:])
        return len(pattern)
    body = "".join(members)
    end = i + 1
    if not complements:
        out.append(f"[{'^' if negated else ''}{body}]")
        return end
    # The characters every negated escape leaves out: [X\D\W] = X ∪ ¬(digits ∩ word).
    kept = frozenset.intersection(*complements)
    if not negated:
        alternatives = [f"[{body}]"] if body else []
        alternatives.append(f"[^{_members(kept)}]" if kept else "[0-9]|[^0-9]")
        out.append(f"(?:{'|'.join(alternatives)})")
        return end
    # [^X\D] = the digits that are not in X: decide membership with Python's regex engine.
    if body:
        try:
            inside = re.compile(f"[{body}]", re.ASCII)
        except re.error as exc:
            raise InvalidRequest(f"`{param}`: invalid character class [{body}]: {exc}", param=param) from exc
        kept = frozenset(ch for ch in kept if not inside.fullmatch(ch))
    if not kept:
        raise InvalidRequest(f"`{param}`: the class {pattern[start:end]} matches no character", param=param)
    out.append(f"[{_members(kept)}]")
    return end


def ascii_schema_patterns(schema: Any, param: str) -> Any:
    """A copy of `schema` with `pattern` values and `patternProperties` keys rewritten by
    `ascii_classes` (data keywords such as `enum` and `default` are left alone)."""
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key in _DATA_KEYWORDS:
                out[key] = value
            elif key == "pattern" and isinstance(value, str):
                out[key] = ascii_classes(value, param)
            elif key == "patternProperties" and isinstance(value, dict):
                out[key] = {
                    ascii_classes(k, param): ascii_schema_patterns(v, param) for k, v in value.items()
                }
            else:
                out[key] = ascii_schema_patterns(value, param)
        return out
    if isinstance(schema, list):
        return [ascii_schema_patterns(v, param) for v in schema]
    return schema
