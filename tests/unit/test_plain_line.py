"""The plain shape of a batch line (app/schemas/plain_line.py) is a shortcut to accepting a
line, never a second opinion: on generated lines in and around that shape, an upload's
checker with it and one without give the same answer (the same custom_id, text and tokens,
or the same error); and the shortcut is taken where it applies and given up where it
does not."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from app.errors import LlmqError
from app.schemas.plain_line import PlainChatBody
from app.services.contract import CounterMemo, RequestPolicy
from app.services.files import PLAIN_MISSES, LineChecker
from app.settings import Settings
from tests.fuzzing import fuzz_settings
from tests.unit.fakes import served

FUZZ = fuzz_settings(300)
# Small bounds, so that generated lines cross them.
SETTINGS = Settings(max_n=2, max_tokens_limit=50, max_messages=3, max_stop_sequences=2)
POLICIES = (
    RequestPolicy(SETTINGS, served("m")),
    RequestPolicy(SETTINGS, served("m", max_model_len=120)),
)

texts = st.text(max_size=12)
plain_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": texts},
    optional={"name": texts | st.none()},
)
# One way a line can leave the plain shape, or a line of another shape altogether.
other_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "function", "x"]),
        "content": texts
        | st.none()
        | st.integers()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
    },
    optional={"name": texts | st.none(), "tool_call_id": texts, "refusal": texts},
)
other_fields = st.fixed_dictionaries(
    {},
    optional={
        "stream": st.booleans(),
        "metadata": st.dictionaries(texts, texts, max_size=2),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 30),
        "user": texts,
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    },
)
PLAIN_NUMBERS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "n",
)


def rarely(draw: st.DrawFn) -> bool:
    """True about one time in eight: a line leaves the plain shape, or crosses a bound, in
    one place at a time, so that most lines reach the plain checks' last step."""
    return draw(st.sampled_from([False] * 7 + [True]))


@st.composite
def lines(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = draw(
        st.lists(plain_message, min_size=0 if rarely(draw) else 1, max_size=4)
    )
    if messages and rarely(draw):
        messages[draw(st.integers(0, len(messages) - 1))] = draw(other_message)
    body: dict[str, Any] = {"model": draw(st.sampled_from(["other", ""])) if rarely(draw) else "m"}
    body["messages"] = messages
    for name in PLAIN_NUMBERS:
        if draw(st.sampled_from([False] * 3 + [True])):
            # Mostly values every bound takes, sometimes one past a bound or of another kind.
            edge = (
                st.integers(-3, 60)
                | st.floats(-3, 3)
                | st.sampled_from([None, math.nan, math.inf, 2**70, "1"])
            )
            usual = (
                st.integers(1, 2)
                if name in ("max_tokens", "max_completion_tokens", "seed", "n")
                else st.floats(0, 1)
            )
            body[name] = draw(edge if rarely(draw) else usual)
    if draw(st.sampled_from([False] * 3 + [True])):
        body["stop"] = draw(st.none() | texts | st.lists(texts, max_size=3))
    if rarely(draw):
        body.update(draw(other_fields))
    custom_id = (
        draw(st.sampled_from(["", "x\x00"]))
        if rarely(draw)
        else draw(st.sampled_from("ab") | st.text(min_size=1, max_size=8))
    )
    return {
        "custom_id": custom_id,
        "method": "GET" if rarely(draw) else "POST",
        "url": draw(
            st.sampled_from(
                ["/v1/completions", "/x"]
                if rarely(draw)
                else ["/v1/chat/completions", "/v2/chat/completions"]
            )
        ),
        "body": body,
    }


def answer(checker: LineChecker, number: int, raw: bytes) -> Any:
    try:
        return checker.check(number, raw)
    except LlmqError as exc:
        return (exc.status, exc.code, exc.param, exc.message)


@FUZZ
@given(st.lists(lines(), min_size=1, max_size=4))
def test_the_plain_shape_gives_the_full_checks_answer(lines: list[dict[str, Any]]) -> None:
    same_answer(lines, one_upload=True)


PROBES: tuple[Any, ...] = (
    -(2**63) - 1,
    -3,
    -2.5,
    -2,
    -1,
    0,
    0.5,
    1,
    2,
    2.5,
    3,
    2**63,
    1e308,
    "1",
    True,
    None,
    [],
    ["x"],
)


def same_answer(lines: list[dict[str, Any]], *, one_upload: bool = False) -> None:
    """Each line (or, `one_upload`, the lines in turn) through a checker with the plain
    shape and one without: the same answers. Each line apart by default, since an upload
    stops trying the plain shape after PLAIN_MISSES lines of another."""
    for policy in POLICIES:
        with_plain = without = None
        for number, one in enumerate(lines, start=1):
            if with_plain is None or without is None or not one_upload:
                with_plain = LineChecker(policy, exact_tokens=False)
                without = LineChecker(policy, exact_tokens=False, plain=False)
            raw = json.dumps({"custom_id": f"c{number}"} | one).encode()
            assert answer(with_plain, number, raw) == answer(without, number, raw), raw


def chat_line(body: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A line with `body`, its own custom_id unless `top` sets one, and `top`'s fields."""
    return {"method": "POST", "url": "/v1/chat/completions", "body": body} | top


def test_every_plain_field_at_and_past_its_bounds_gives_the_full_checks_answer() -> None:
    user = [{"role": "user", "content": "x"}]
    for name in sorted(set(PlainChatBody.model_fields) - {"messages"}):
        same_answer([chat_line({"model": "m", "messages": user, name: value}) for value in PROBES])
    same_answer([chat_line({"model": "m", "messages": user * n}) for n in range(5)])
    same_answer([chat_line({"model": "m", "messages": user, "stop": ["s"] * n}) for n in range(4)])


def test_every_message_shape_gives_the_full_checks_answer() -> None:
    roles = ["system", "developer", "user", "assistant", "tool", "function", "x", None]
    content: list[Any] = ["x", "", None, 1, [{"type": "text", "text": "x"}], {"text": "x"}]
    extras: list[dict[str, Any]] = [{}, {"name": "n"}, {"name": None}, {"name": 1}, {"tool_call_id": "t"}]
    same_answer(
        [
            chat_line({"model": "m", "messages": [{"role": r, "content": c, **e}]})
            for r in roles
            for c in content
            for e in extras
        ]
        + [chat_line({"model": "m", "messages": [{"role": "user"}]})]
    )


def test_every_envelope_gives_the_full_checks_answer() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    same_answer(
        [chat_line(body, custom_id=c) for c in ("", "x" * 512, "x" * 513, "a\x00", 1, None)]
        + [chat_line(body, method=m) for m in ("GET", "post", None)]
        + [chat_line(body, url=u) for u in ("/v2/chat/completions", "/v1/completions", "/x", None)]
        + [chat_line(body, extra=1), {"method": "POST", "url": "/v1/chat/completions"}]
    )
    same_answer([chat_line(body, custom_id="a"), chat_line(body, custom_id="a")], one_upload=True)


class Counting(RequestPolicy):
    """A policy that counts which way each line went."""

    def __init__(self) -> None:
        super().__init__(SETTINGS, served("m"))
        self.plain = self.full = 0

    def plain_line_tokens(self, body: PlainChatBody, memo: CounterMemo) -> int | None:
        self.plain += 1
        return super().plain_line_tokens(body, memo)

    def check(self, req: Any, *, streaming: bool = False, count_tokens: bool = True) -> None:
        self.full += 1
        super().check(req, streaming=streaming, count_tokens=count_tokens)


def raw_line(custom_id: str, **extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    ).encode()


def test_plain_lines_skip_the_full_check_and_other_lines_take_it() -> None:
    policy = Counting()
    checker = LineChecker(policy, exact_tokens=False)
    checker.check(1, raw_line("a"))
    checker.check(2, raw_line("b", metadata={"k": "v"}))
    assert (policy.plain, policy.full) == (1, 1)


def test_an_upload_of_another_shape_stops_trying_the_plain_one() -> None:
    policy = Counting()
    checker = LineChecker(policy, exact_tokens=False)
    for n in range(PLAIN_MISSES + 5):
        checker.check(n, raw_line(f"c{n}", metadata={"k": "v"}))
    assert policy.full == PLAIN_MISSES + 5
    checker.check(99, raw_line("plain"))
    assert (policy.plain, policy.full) == (0, PLAIN_MISSES + 6)


def test_counting_with_the_tokenizer_takes_the_full_check() -> None:
    policy = Counting()
    LineChecker(policy, exact_tokens=True).check(1, raw_line("a"))
    assert (policy.plain, policy.full) == (0, 1)
