from __future__ import annotations

import json

from app.jsontext import compact, compact_bytes, loads


def test_compact_json_is_utf8_and_escapes_control_characters() -> None:
    value = {"a": ["é ☃ \U0001f600 \u2028", 1.5, None, 2**70], "b": '\u0000\n"', "c": (1, 2)}
    expected = '{"a":["é ☃ \U0001f600 \u2028",1.5,null,1180591620717411303424],"b":"\\u0000\\n\\"","c":[1,2]}'
    assert compact(value) == expected
    assert json.loads(compact_bytes(value)) == {**value, "c": [1, 2]}


def test_a_string_utf8_cannot_hold_is_escaped_as_json_dumps_does() -> None:
    """A lone surrogate (a JSON escape can carry one in) is left to json.dumps."""
    assert compact({"a": "x\ud800"}) == '{"a":"x\\ud800"}'
    assert json.loads(compact_bytes({"a": "x\ud800"})) == {"a": "x\ud800"}
    assert loads(compact_bytes({"a": "x\ud800"})) == {"a": "x\ud800"}  # a stream event's round trip


def test_loads_reads_what_json_loads_reads() -> None:
    document = '{"a": [1, 1.5, -0, 1e400, null, true], "b": "\\u0000\\ud83d\\ude00 é"}'
    texts = (document, "12345678901234567890123")
    for text in texts:
        assert loads(text) == json.loads(text)
        assert loads(text.encode()) == json.loads(text)


def test_loads_takes_nesting_past_the_fast_parsers_limit() -> None:
    deep = "[" * 500 + "]" * 500
    assert loads(deep) == json.loads(deep)
