"""Hypothesis against the two parsers that read untrusted text: a batch input line and the
`Last-Event-ID` header. Either a clean result or the one refusal type, never a crash; and
what they accept means what it says. `bash scripts/fuzz.sh` runs these longer."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from app.errors import InvalidRequest, LlmqError
from app.events import EventId, parse_event_id
from app.services.contract import RequestPolicy
from app.services.files import LineChecker
from app.settings import Settings
from tests.fuzzing import fuzz_settings
from tests.unit.fakes import served

FUZZ = fuzz_settings(200)
POLICY = RequestPolicy(Settings(), served("m"))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"]), "content": json_values}
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "other"]), "messages": messages},
    optional={
        "max_tokens": json_values,
        "temperature": json_values,
        "n": json_values,
        "stream": st.booleans(),
        "stop": json_values,
        "logit_bias": json_values,
        "guided_json": json_values,
    },
)
lines = st.fixed_dictionaries(
    {
        "custom_id": st.text(max_size=12) | json_values,
        "method": st.sampled_from(["POST", "GET"]),
        "url": st.sampled_from(["/v1/chat/completions", "/v2/chat/completions", "/v1/embeddings"]),
        "body": bodies | json_values,
    }
)


def check(raw: bytes, checker: LineChecker | None = None) -> tuple[str, str, int] | None:
    try:
        return (checker or LineChecker(POLICY)).check(1, raw)
    except LlmqError as exc:
        assert exc.status == 400 and exc.message
        return None


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_are_a_line_or_a_400(raw: bytes) -> None:
    check(raw)


@FUZZ
@given(lines, st.sampled_from([b"", b"\r", b" "]))
def test_structured_lines_are_accepted_only_when_they_are_what_they_say(line: dict, tail: bytes) -> None:
    result = check(json.dumps(line).encode() + tail)
    if result is not None:
        custom_id, text, tokens = result
        parsed = json.loads(text)
        assert tokens > 0
        assert parsed["custom_id"] == custom_id and isinstance(custom_id, str)
        assert parsed["method"] == "POST"
        assert parsed["url"] in ("/v1/chat/completions", "/v2/chat/completions")
        assert parsed["body"].get("stream") is not True
        assert parsed["body"]["model"] == "m"


# Any custom_id Postgres text can hold: not U+0000 (a line error of its own) nor a lone surrogate.
STORABLE = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))


@FUZZ
@given(st.text(STORABLE, min_size=1, max_size=12), st.integers(1, 5))
def test_a_custom_id_is_accepted_once(custom_id: str, repeats: int) -> None:
    checker = LineChecker(POLICY)
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    }
    accepted = [check(json.dumps(line).encode(), checker) for _ in range(repeats)]
    assert accepted[0] is not None and all(a is None for a in accepted[1:])


@FUZZ
@given(st.text(max_size=40))
def test_any_last_event_id_parses_or_is_a_400(raw: str) -> None:
    try:
        parsed = parse_event_id(raw)
    except InvalidRequest as exc:
        assert exc.param == "Last-Event-ID"
        return
    assert parsed is None or str(parsed) == raw.strip()


@FUZZ
@given(st.integers(0, 10**18 - 1), st.integers(0, 2**63))
def test_every_event_id_sent_parses_back(epoch: int, seq: int) -> None:
    assert parse_event_id(str(EventId(epoch, seq))) == EventId(epoch, seq)
