"""An upload's lines are read with bounded memory: a line over the limit is refused, named,
before it is read whole (a one-line file of 199 MB must not sit in memory)."""

from __future__ import annotations

import io

import pytest

from app.errors import PayloadTooLarge
from app.services.files import bounded_lines


class EndlessLine(io.RawIOBase):
    """One line that never ends; records the largest read."""

    def __init__(self) -> None:
        self.largest = 0

    def readline(self, size: int | None = -1) -> bytes:
        assert size is not None and size > 0, "an unbounded readline would never return"
        self.largest = max(self.largest, size)
        return b"x" * size


def test_lines_within_the_limit_pass_unchanged() -> None:
    data = b'{"a": 1}\r\n' + b"y" * 100 + b"\n" + b"z" * 100
    assert list(bounded_lines(io.BytesIO(data), 100)) == [b'{"a": 1}\r\n', b"y" * 100 + b"\n", b"z" * 100]


def test_a_line_over_the_limit_is_refused_by_number() -> None:
    data = b"ok\n" + b"x" * 101 + b"\nok\n"
    with pytest.raises(PayloadTooLarge) as exc:
        list(bounded_lines(io.BytesIO(data), 100))
    assert "line 2" in exc.value.message and exc.value.code == "line_too_large"


def test_a_huge_line_is_never_read_whole() -> None:
    stream = EndlessLine()
    with pytest.raises(PayloadTooLarge):
        list(bounded_lines(stream, 32 * 2**20))  # type: ignore[arg-type]
    assert stream.largest <= 32 * 2**20 + 2
