"""Structured outputs: the bounds, the ASCII rewrite of `\\d \\w \\s`, and the sandbox that
compiles constraints where a crash costs nothing (issue 9 item 1, issue 10 defect 1)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from app.domain.structured import Constraint, ascii_classes, ascii_schema_patterns, constraint
from app.domain.tools import plan_tools
from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request
from app.services.contract import RequestPolicy
from app.services.sandbox import ConstraintSandbox
from app.settings import Settings
from tests.bombs import chained_grammar, ref_chain_schema
from tests.unit.fakes import served


def req(**fields) -> ChatCompletionV2Request:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionV2Request.model_validate(body)


# --- ASCII classes -----------------------------------------------------------------------

# ASCII, and the non-ASCII digits, letters and spaces a Unicode `\d \w \s` would take.
SAMPLE = [chr(c) for c in range(128)] + list("٣᠒꤂𝟘é߀ßЖ\u00a0\u2003\u3000\ufeff")

PATTERNS = [
    r"\d",
    r"\D",
    r"\w",
    r"\W",
    r"\s",
    r"\S",
    r"[\d]",
    r"[^\d]",
    r"[\D]",
    r"[^\D]",
    r"[a\D]",
    r"[^a\D]",
    r"[^3-5\D]",
    r"[\D\W]",
    r"[^\D\W]",
    r"[\W\d]",
    r"[^\W\d]",
    r"[x-z\S\d]",
    r"[^x-z\S]",
    r"[\s\w]",
    r"[^\s\w]",
    r"[\D\S]",
    r"[\\d]",
    r"[\]\d]",
    r"[]\d]",
    r"[.\w-]",
    r"[\x41\d]",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rewrite_means_the_ascii_class_for_every_character(pattern: str) -> None:
    rewritten = ascii_classes(pattern)
    assert "\\d" not in rewritten.replace("\\\\", "") and "\\w" not in rewritten.replace("\\\\", "")
    # Unicode semantics for the rewrite, ASCII semantics for the original: they must agree.
    for ch in SAMPLE:
        want = re.fullmatch(pattern, ch, re.ASCII) is not None
        got = re.fullmatch(rewritten, ch) is not None
        assert got == want, (pattern, rewritten, ch)


def test_date_pattern_takes_ascii_digits_only() -> None:
    rewritten = ascii_classes(r"\d{4}-\d{2}-\d{2}")
    assert rewritten == "[0-9]{4}-[0-9]{2}-[0-9]{2}"
    assert re.fullmatch(rewritten, "2024-01-31")
    assert not re.fullmatch(rewritten, "᠒3٧𞓹-٣8-꤂🯷")


def test_escaped_backslash_is_a_literal_not_a_class() -> None:
    assert ascii_classes(r"\\d") == r"\\d"
    assert ascii_classes(r"\\\d") == r"\\[0-9]"
    assert re.fullmatch(ascii_classes(r"a\\d"), "a\\d")


def test_other_escapes_and_groups_are_kept() -> None:
    for pattern in [r"\.\+\(\)\{\}", r"\bfoo\B", r"(?:ab|cd)+", r"\u0041\x42\n\t", r"\p{L}+", r"[[:alpha:]]"]:
        assert ascii_classes(pattern) == pattern


def test_rewritten_class_with_a_quantifier_stays_one_unit() -> None:
    rewritten = ascii_classes(r"[a\D]{3}")
    assert re.fullmatch(rewritten, "a!b")
    assert not re.fullmatch(rewritten, "a1b")


def test_negated_class_that_matches_nothing_is_a_400() -> None:
    with pytest.raises(InvalidRequest) as exc:
        ascii_classes(r"[^0-9\D]", "guided_regex")
    assert exc.value.param == "guided_regex"


def test_schema_patterns_and_pattern_properties_are_rewritten_but_not_data() -> None:
    schema = {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": r"^\d{4}$"},
            "pattern": {"type": "string", "enum": [r"\d"], "default": r"\w"},
            "list": {"type": "array", "items": {"pattern": r"\s+"}},
        },
        "patternProperties": {r"^\w+$": {"type": "string"}},
        "examples": [{"pattern": r"\d"}],
    }
    out = ascii_schema_patterns(schema, "guided_json")
    assert out["properties"]["date"]["pattern"] == "^[0-9]{4}$"
    assert out["properties"]["pattern"]["enum"] == [r"\d"]
    assert out["properties"]["pattern"]["default"] == r"\w"
    assert out["properties"]["list"]["items"]["pattern"] == r"[\t\n\x0B\x0C\r ]+"
    assert list(out["patternProperties"]) == ["^[A-Za-z0-9_]+$"]
    assert out["examples"] == [{"pattern": r"\d"}]
    assert schema["properties"]["date"]["pattern"] == r"^\d{4}$"  # the request is not changed


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_regex": r"\d+"},
        {"guided_json": {"type": "string", "pattern": r"\d+"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": {"type": "string", "pattern": r"\d+"}},
            }
        },
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"pattern": r"\d+"}}},
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
    ],
)
def test_every_constraint_field_reaches_the_engine_rewritten(fields) -> None:
    r = req(**fields)
    kwargs = constraint(r, plan_tools(r, auto_parser=None))
    assert kwargs is not None
    assert "\\d" not in str(kwargs) and "[0-9]+" in str(kwargs)


# --- bounds ------------------------------------------------------------------------------

SMALL = Settings(
    max_schema_bytes=2000,
    max_schema_refs=10,
    max_schema_ref_depth=5,
    max_grammar_rules=20,
    max_regex_length=50,
    max_choices=5,
    max_choice_bytes=10,
)
POLICY = RequestPolicy(SMALL, served("m"))


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("fields", "param", "bound"),
    [
        ({"guided_json": {"enum": ["x" * 3000]}}, "guided_json", "2000"),
        ({"response_format": schema_format(ref_chain_schema(4))}, None, None),
        ({"response_format": schema_format(ref_chain_schema(8))}, "response_format.json_schema.schema", "5"),
        ({"guided_json": ref_chain_schema(12)}, "guided_json", "10"),
        ({"guided_grammar": chained_grammar(21)}, "guided_grammar", "20"),
        ({"guided_grammar": chained_grammar(18)}, None, None),
        ({"guided_grammar": "start: " + "x" * 2100}, "guided_grammar", "2000"),
        ({"guided_regex": "a" * 51}, "guided_regex", "50"),
        ({"guided_json": {"type": "string", "pattern": "a" * 51}}, "guided_json", "50"),
        ({"guided_choice": list("abcdef")}, "guided_choice", "5"),
        ({"guided_choice": ["a", "b" * 11]}, "guided_choice[1]", "10"),
        (
            {"tools": [tool("f", {}), tool("g", ref_chain_schema(8))], "tool_choice": "required"},
            "tools[1].function.parameters",
            "5",
        ),
        (
            {
                "tools": [tool("f", {}), tool("g", ref_chain_schema(8))],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tools[1].function.parameters",
            "5",
        ),
    ],
)
def test_bounds_are_400s_naming_the_field_and_the_bound(fields, param: str | None, bound: str | None) -> None:
    if param is None:
        POLICY.check(req(**fields))  # at the bounds, not over them
        return
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(**fields))
    assert exc.value.param == param
    assert f"limit is {bound}" in exc.value.message


def test_ref_count_is_bounded() -> None:
    refs = {f"p{i}": {"$ref": "#/$defs/s"} for i in range(11)}
    schema = {"$defs": {"s": {"type": "string"}}, "type": "object", "properties": refs}
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(guided_json=schema))
    assert exc.value.param == "guided_json" and "limit is 10" in exc.value.message


def test_a_recursive_schema_is_not_an_endless_ref_chain() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    POLICY.check(req(guided_json=tree))


def test_default_bounds_refuse_the_bombs_from_the_issue() -> None:
    policy = RequestPolicy(Settings(), served("m"))
    for fields, param in [
        ({"response_format": schema_format(ref_chain_schema())}, "response_format.json_schema.schema"),
        ({"guided_grammar": chained_grammar()}, "guided_grammar"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            policy.check(req(**fields))
        assert exc.value.param == param


def test_out_of_vocabulary_token_ids_are_400s() -> None:
    policy = RequestPolicy(Settings(), served("m", vocab_size=100))
    policy.check(req(logit_bias={"99": 1}, stop_token_ids=[99]))
    for fields, param in [
        ({"logit_bias": {"100": 1}}, "logit_bias"),
        ({"stop_token_ids": [5, 100]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            policy.check(req(**fields))
        assert exc.value.param == param
    # Without a known vocabulary, a negative id is still refused.
    with pytest.raises(InvalidRequest):
        RequestPolicy(Settings(), served("m")).check(req(stop_token_ids=[-3]))


# --- the sandbox -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox():
    box = ConstraintSandbox("guidance", processes=2, timeout_seconds=10)
    yield box
    box.close()


def test_a_constraint_that_segfaults_the_compiler_is_a_400_for_it_alone(sandbox: ConstraintSandbox) -> None:
    for found in [
        Constraint("response_format.json_schema.schema", {"json": ref_chain_schema()}),
        Constraint("guided_grammar", {"grammar": chained_grammar()}),
    ]:
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as exc:
            sandbox.check(found)
        assert exc.value.param == found.param
        assert "crashed" in exc.value.message
        assert time.monotonic() - started < 10
    # The pool was replaced: the next constraint compiles.
    sandbox.check(Constraint("guided_regex", {"regex": "[0-9]{4}"}))


def test_compiler_children_run_at_a_lower_cpu_priority(sandbox: ConstraintSandbox) -> None:
    """A compile burning its time limit gets only the CPU other requests leave."""
    import psutil

    sandbox.check(Constraint("guided_regex", {"regex": "[a-z]{3}"}))
    children = [c for c in psutil.Process().children() if "constraint_child" in " ".join(c.cmdline())]
    assert children
    assert all(c.nice() >= psutil.Process().nice() + 10 for c in children)


def test_an_invalid_regex_is_a_400_naming_its_field(sandbox: ConstraintSandbox) -> None:
    for found in [
        Constraint("guided_regex", {"regex": "a(b"}),
        Constraint("guided_json", {"json": {"type": "string", "pattern": "a(b"}}),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            sandbox.check(found)
        assert exc.value.param == found.param and "unclosed group" in exc.value.message


def test_valid_constraints_pass(sandbox: ConstraintSandbox) -> None:
    for kwargs in [
        {"json": {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]+$"}}}},
        {"choice": ["yes", "no"]},
        {"grammar": 'start: "a" | "b"'},
        {"json_object": True},
        {"json": ref_chain_schema(50)},
    ]:
        sandbox.check(Constraint("p", kwargs))


def test_verdicts_are_cached_per_backend_and_constraint(sandbox: ConstraintSandbox) -> None:
    shared = Constraint(
        "guided_json", {"json": {"type": "object", "properties": {"id": {"type": "integer"}}}}
    )
    before = sandbox.compiles
    started = time.monotonic()
    for _ in range(5000):
        sandbox.check(Constraint(shared.param, dict(shared.kwargs)))
    assert sandbox.compiles == before + 1
    assert time.monotonic() - started < 5  # a cache hit is a hash, not a compile
    bomb = Constraint("guided_grammar", {"grammar": chained_grammar()})
    with pytest.raises(InvalidRequest):
        sandbox.check(bomb)
    before = sandbox.compiles
    with pytest.raises(InvalidRequest):
        sandbox.check(bomb)
    assert sandbox.compiles == before  # a refusal is cached too: the bomb does not run again


def test_a_compile_past_the_time_limit_is_a_400_and_the_child_is_replaced() -> None:
    box = ConstraintSandbox("guidance", processes=1, timeout_seconds=0.5)
    try:
        box.check(Constraint("guided_regex", {"regex": "[a-z]"}))  # starts the child
        stalled = box._idle.queue[0]
        assert stalled is not None
        os.kill(stalled.proc.pid, signal.SIGSTOP)  # a compile that never ends
        with pytest.raises(InvalidRequest) as exc:
            box.check(Constraint("guided_regex", {"regex": "[a-z]+"}))
        assert exc.value.param == "guided_regex" and "longer than 0.5 s" in exc.value.message
        assert stalled.proc.poll() is not None  # killed
        box.check(Constraint("guided_regex", {"regex": "[a-z]*"}))  # a new child answers
        assert box._idle.queue[0] is not stalled
    finally:
        box.close()


def test_policy_compiles_in_the_sandbox_before_queuing(sandbox: ConstraintSandbox) -> None:
    roomy = Settings(
        max_schema_bytes=1 << 20, max_schema_refs=5000, max_schema_ref_depth=5000, max_grammar_rules=10**6
    )
    policy = RequestPolicy(roomy, served("m"), constraints=sandbox)
    with pytest.raises(InvalidRequest) as exc:
        policy.check(req(guided_grammar=chained_grammar()))
    assert exc.value.param == "guided_grammar" and "crashed" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        policy.check(req(guided_regex="(unclosed"))
    assert exc.value.param == "guided_regex"
    policy.check(req(guided_regex=r"\d{4}-\d{2}-\d{2}"))


def test_a_shared_schema_is_rewritten_and_bounded_once_per_process() -> None:
    from app.domain.structured import ConstraintLimits, check_limits, constraint_of

    props = {f"f{i}": {"type": "string", "pattern": r"^\d+$"} for i in range(300)}
    lines = [req(guided_json={"type": "object", "properties": props}) for _ in range(2)]
    first, second = (constraint_of(r, plan_tools(r, auto_parser=None)) for r in lines)
    assert first is not None and second is not None
    assert first.digest == second.digest and first.kwargs is second.kwargs  # one rewrite
    limits = ConstraintLimits.of(Settings())
    check_limits(first, plan_tools(lines[0], auto_parser=None), limits)
    started = time.monotonic()
    for _ in range(2000):
        check_limits(second, plan_tools(lines[1], auto_parser=None), limits)
    assert time.monotonic() - started < 2  # a cache hit, not a walk of the schema
