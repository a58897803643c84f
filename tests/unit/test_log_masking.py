"""The log formatter's masking skips a pattern when a line lacks its gate (app/logs.py
`_PATTERNS`); skipping must never change what is masked. Each case compares
`mask_secrets` with every pattern applied to every line, on lines built from the patterns'
own pieces in any casing, the non-ASCII letters that IGNORECASE matches to ASCII ones
included."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app import logs
from app.logs import mask_secrets
from tests.fuzzing import fuzz_settings

pytestmark = pytest.mark.unit

FUZZ = fuzz_settings(200, scale=10)

PIECES = [
    "Bearer ",
    "basic ",
    "QWxhZGRpbjpvcGVu",
    "Authorization",
    "api_key",
    "api-key",
    "KEY",
    "token",
    "secret",
    "Passwd",
    "password",
    "credential",
    "://user:pw@host",
    "Failing row contains (",
    "COPY jobs, line 3: ",
    ", column request",
    "JSON data, line 1: ",
    "Key (tenant_id)=(",
    'Token "x" is invalid',
    "invalid input syntax for type json: ",
    "invalid input value for enum x: ",
    "llmq-abcdefghij",
    "sk-abcdefghijk",
    "\u017fecret",  # long s: IGNORECASE matches it to s
    "\u212aey",  # Kelvin sign: to k
    "toke\u0131",  # dotless i
    "author\u0130zation",  # dotted capital I
    "bas\u0130c ",
    "=",
    ": ",
    '\\"',
    "'",
    "\u00a0:",
    "***",
    "\n",
]
lines = st.lists(
    st.sampled_from(PIECES) | st.text(alphabet="abcKEYsSiI_-=:'\" \\/@,;(){}*0123456789é", max_size=8),
    max_size=10,
).map("".join)


def every_pattern(text: str) -> str:
    """What `mask_secrets` gives without its gates (no secret registered)."""
    for _, pattern, replacement in logs._PATTERNS:
        text = pattern.sub(replacement, text)
    return text


@FUZZ
@given(line=lines)
def test_gates_never_change_what_is_masked(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_SECRETS_LONGEST_FIRST", ())
    assert mask_secrets(line) == every_pattern(line)


@pytest.mark.parametrize(
    ("line", "masked"),
    [
        ("job accepted job_id=job_1 tenant=t1", "job accepted job_id=job_1 tenant=t1"),
        ("retry with \u017fECRET=hunter22", "retry with \u017fECRET=***"),
        ("\u212aEY: abcdefgh", "\u212aEY: ***"),
        (
            "authoriz\u0131tion? no: AUTHOR\u0130ZATION=abcdefgh",
            "authoriz\u0131tion? no: AUTHOR\u0130ZATION=***",
        ),
        ("basic QWxhZGRpbjpvcGVu and BA\u017fIC QWxhZGRpbjpvcGVu", "basic *** and BA\u017fIC ***"),
    ],
)
def test_non_ascii_letters_that_match_ascii_ones_pass_the_gates(
    line: str, masked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "_SECRETS_LONGEST_FIRST", ())
    assert mask_secrets(line) == masked == every_pattern(line)
