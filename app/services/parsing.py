"""Turning raw request bytes into typed models, with errors that name the field.

Size and nesting are checked on the bytes before any JSON parser sees them, so a 10,000-deep
document or a huge body is refused in linear time with flat memory. What parses but cannot be
carried on (a lone surrogate, which no UTF-8 encoder, tokenizer or database accepts; a number
too long to convert or too large for a float; `NaN`/`Infinity`, which are not JSON) is refused
right after parsing with the field named, so no later layer meets it as a 500.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)

# Tagged unions put the tag into the error location right after these paths.
_TAGGED_AFTER_INDEX = {"messages", "content"}
_TAGGED_FIELDS = {"response_format"}
_PRIMITIVES = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance"}

# Python's own default guard on int<->str conversion, and the bound the batch line parser
# (pydantic's jiter) applies, so a single request and a batch line accept the same numbers.
MAX_INT_DIGITS = 4300
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class _Unusable(str):
    """A number the parser met that cannot be carried on; found and named by the walk below."""


def check_size(raw: bytes, limit: int) -> None:
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit} bytes")


def check_depth(raw: bytes, limit: int) -> None:
    """Refuse JSON nested deeper than `limit` without recursing."""
    depth = 0
    in_string = False
    escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x7B, 0x5B):  # { [
            depth += 1
            if depth > limit:
                raise InvalidRequest(f"JSON is nested more than {limit} levels deep", code="too_deep")
        elif byte in (0x7D, 0x5D):
            depth -= 1


def _parse_int(text: str) -> int | _Unusable:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Unusable(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def load_json(raw: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """Parse a request body. Raises PayloadTooLarge, or InvalidRequest naming the field
    (`param`) that holds what cannot be carried on."""
    check_size(raw, max_bytes)
    check_depth(raw, max_depth)
    return decode_json(raw)


def decode_json(raw: bytes) -> Any:
    """Parse JSON whose size and depth are already bounded; InvalidRequest as load_json.

    The common body pays almost nothing: the parse runs at C speed (hooks fire only for
    floats and NaN/Infinity), and the walk that names a field runs only when the parse met
    something unusable or the bytes hold a surrogate escape (the only way a lone
    surrogate gets in: raw UTF-8 cannot encode one)."""
    unusable: list[_Unusable] = []

    def refuse(why: str) -> _Unusable:
        unusable.append(_Unusable(why))
        return unusable[-1]

    def parse_float(text: str) -> float | _Unusable:
        value = float(text)
        return value if math.isfinite(value) else refuse("a number too large for a 64-bit float")

    def parse_constant(text: str) -> _Unusable:
        return refuse(f"{text}, which is not JSON")

    try:
        try:
            data = json.loads(raw, parse_float=parse_float, parse_constant=parse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise
        except ValueError:
            # An integer past Python's digit limit: parse again, marking it, to name it.
            data = json.loads(
                raw, parse_int=_parse_int, parse_float=parse_float, parse_constant=parse_constant
            )
            unusable.append(_Unusable(""))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from exc
    if unusable or _SURROGATE_ESCAPE.search(raw):
        _walk(data, [])
    return data


def _show(name: str) -> str:
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _where(path: list[str | int]) -> str | None:
    out = "".join(
        f"[{p}]" if isinstance(p, int) else f".{_show(p)}" if i else _show(p) for i, p in enumerate(path)
    )
    return out or None


def _refuse_scalar(value: Any, path: list[str | int]) -> None:
    if type(value) is _Unusable:
        where = _where(path)
        raise InvalidRequest(
            f"Invalid value for {where or 'the body'}: {value}", param=where, code="invalid_number"
        )
    if type(value) is str and _SURROGATE.search(value):
        where = _where(path)
        raise InvalidRequest(
            f"Invalid value for {where or 'the body'}: the string holds a lone UTF-16 surrogate "
            "(an unpaired \\ud800-\\udfff escape), which is not a character",
            param=where,
            code="invalid_string",
        )


def _walk(value: Any, path: list[str | int]) -> None:
    """Refuse the first string or key holding a lone surrogate and the first unusable
    number, naming where it is. Recursive: depth is bounded before parsing."""
    if type(value) is dict:
        for key, item in value.items():
            path.append(key)
            if _SURROGATE.search(key):
                where = _where(path)
                raise InvalidRequest(
                    f"Invalid key {where}: it holds a lone UTF-16 surrogate",
                    param=where,
                    code="invalid_string",
                )
            _walk(item, path)
            path.pop()
    elif type(value) is list:
        for i, item in enumerate(value):
            path.append(i)
            _walk(item, path)
            path.pop()
    else:
        _refuse_scalar(value, path)


def error_param(loc: tuple[int | str, ...]) -> str | None:
    """`('messages', 0, 'user', 'content')` → `'messages[0].content'`.

    Pydantic inserts union member names (`str`, `list[...]`) and discriminator tags
    (`user`) into locations; they are not fields, so they are dropped.
    """
    parts: list[str] = []
    last: int | str | None = None
    expect_tag = False
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            expect_tag = last in _TAGGED_AFTER_INDEX
            last = item
            continue
        if "[" in item or item in _PRIMITIVES:
            continue
        if expect_tag:
            expect_tag = False
            continue
        parts.append(("." if parts else "") + item)
        expect_tag = item in _TAGGED_FIELDS
        last = item
    return "".join(parts) or None


def describe(error: dict[str, Any]) -> str:
    kind = error.get("type")
    param = error_param(tuple(error.get("loc", ())))
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return f"Missing required parameter: {param}"
    msg = str(error.get("msg", "invalid value"))
    return f"Invalid value for {param}: {msg}" if param else msg


def parse_model(model: type[M], data: Any) -> M:
    """Validate `data` as `model`; the first problem becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        first = _most_specific(errors)
        raise InvalidRequest(
            describe(first),
            param=error_param(tuple(first.get("loc", ()))),
            code=str(first.get("type")),
        ) from exc


def _most_specific(errors: list[Any]) -> dict[str, Any]:
    """Of a union's alternatives, report the one that got deepest into the input."""
    found: list[dict[str, Any]] = [dict(e) for e in errors]
    unknown = [e for e in found if e.get("type") == "extra_forbidden"]
    if unknown:
        return unknown[0]
    return max(found, key=lambda e: len(e.get("loc", ())))
