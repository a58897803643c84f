"""The elements of a JSON array read from a stream one at a time: llm-engine's batch input
file is one JSON array (`List[request]`), which may be hundreds of megabytes, so it is
split here without ever holding more than one element (bounded) and one read chunk."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO

from app.errors import InvalidRequest, PayloadTooLarge

CHUNK_BYTES = 1024 * 1024
# Outside a string, the bytes that change the nesting; inside one, its end or an escape.
_STRUCTURE = re.compile(rb'["\[\]{},]')
_IN_STRING = re.compile(rb'["\\]')
_SPACE = b" \t\r\n"


def array_items(stream: IO[bytes], *, max_item_bytes: int, param: str) -> Iterator[bytes]:
    """Each element of the top-level array, as its JSON bytes (not parsed).

    Raises:
        InvalidRequest: the stream is not a JSON array (only its structure is checked here;
            each element is parsed by the caller).
        PayloadTooLarge: an element is over `max_item_bytes`.
    """
    scanner = _Scanner(stream, max_item_bytes, param)
    yield from scanner.items()


class _Scanner:
    def __init__(self, stream: IO[bytes], limit: int, param: str) -> None:
        self._stream = stream
        self._limit = limit
        self._param = param
        self._buf = b""
        self._pos = 0
        self._eof = False
        self._count = 0

    def _more(self) -> bool:
        if self._eof:
            return False
        chunk = self._stream.read(CHUNK_BYTES)
        if not chunk:
            self._eof = True
            return False
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def _skip_space(self) -> bytes:
        """The next byte that is not white space, consumed; b"" at the end."""
        while True:
            while self._pos < len(self._buf) and self._buf[self._pos] in _SPACE:
                self._pos += 1
            if self._pos < len(self._buf):
                found = self._buf[self._pos : self._pos + 1]
                self._pos += 1
                return found
            if not self._more():
                return b""

    def _bad(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"{self._param} is not a JSON array of requests: {what} (after {self._count} items)",
            param=self._param,
            code="invalid_json",
        )

    def items(self) -> Iterator[bytes]:
        if self._skip_space() != b"[":
            raise self._bad("it does not start with '['")
        first = self._skip_space()
        if first == b"]":
            self._tail()
            return
        self._pos -= 1  # the element's first byte
        while True:
            item, end = self._item()
            self._count += 1
            yield item
            if end == b"]":
                self._tail()
                return

    def _tail(self) -> None:
        if self._skip_space() != b"":
            raise self._bad("there is more after the closing ']'")

    def _item(self) -> tuple[bytes, bytes]:
        """One element up to the `,` or `]` that ends it, and that byte."""
        start = self._pos
        depth = 0
        in_string = False
        while True:
            pattern = _IN_STRING if in_string else _STRUCTURE
            match = pattern.search(self._buf, self._pos)
            if match is None:
                if len(self._buf) - start > self._limit:  # all of it is this element so far
                    raise self._too_large()
                offset = len(self._buf) - start
                self._pos = start
                if not self._more():
                    raise self._bad("it ends inside an element")
                start, self._pos = 0, offset
                continue
            at = match.start()
            byte = self._buf[at : at + 1]
            if in_string:
                if byte == b"\\":
                    if at + 1 >= len(self._buf):  # the escaped byte is in the next chunk
                        offset = at - start
                        self._pos = start
                        if not self._more():
                            raise self._bad("it ends inside a string")
                        start, self._pos = 0, offset
                        continue
                    self._pos = at + 2
                    continue
                in_string = False
            elif byte == b'"':
                in_string = True
            elif byte in (b"[", b"{"):
                depth += 1
            elif byte in (b"]", b"}"):
                if depth == 0:
                    if byte == b"}":
                        raise self._bad("an unbalanced '}'")
                    return self._finish(start, at, byte)
                depth -= 1
            elif byte == b"," and depth == 0:
                return self._finish(start, at, byte)
            self._pos = at + 1

    def _finish(self, start: int, at: int, end: bytes) -> tuple[bytes, bytes]:
        item = self._buf[start:at].strip()
        if len(item) > self._limit:
            raise self._too_large()
        if not item:
            raise self._bad("an empty element")
        self._pos = at + 1
        return item, end

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"{self._param}: item {self._count + 1} is over {self._limit} bytes, the limit for one "
            "request (LLMQ_MAX_LINE_BYTES)",
            param=self._param,
            code="line_too_large",
        )
