"""A batch's input read from object storage into an llmq input file, streamed: the object's
body is read as its lines are checked and copied into Postgres (app/services/files.py), the
same path an upload takes, so memory stays bounded whatever the object's size. It runs in
the request that creates the batch, as an upload does (its errors are that request's 400s,
with line numbers). Under gevent a read from the store yields only when no bytes are
waiting, and checking lines is CPU work, so the import also yields every YIELD_EVERY
lines: the process's other requests are served while a large object is read."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app.errors import InvalidRequest, PayloadTooLarge
from app.schemas.batches import FileObject
from app.services.files import FileService, bounded_lines
from app.services.json_items import array_items
from app.services.keys import Principal
from app.services.object_store import ObjectPath, ObjectStore
from app.settings import Settings

YIELD_EVERY = 256

# An item of a JSON array and its 1-based position -> one input file line (no newline).
ItemToLine = Callable[[int, dict[str, object]], bytes]


@dataclass(frozen=True)
class ImportedInput:
    path: ObjectPath
    file: FileObject


class ObjectInputs:
    def __init__(self, store: ObjectStore, files: FileService, settings: Settings) -> None:
        self.store = store
        self._files = files
        self._settings = settings

    def _open(self, principal: Principal, value: str, param: str) -> ObjectPath:
        path = self.store.resolve(principal.tenant_id, value, param=param)
        size = self.store.size(path, param=param)
        if size > self._settings.max_upload_bytes:
            raise PayloadTooLarge(
                f"{param} {path} is {size} bytes, over {self._settings.max_upload_bytes} "
                "(LLMQ_MAX_UPLOAD_BYTES)",
                param=param,
            )
        return path

    def import_jsonl(self, principal: Principal, value: str, *, param: str) -> ImportedInput:
        """An OpenAI batch input file (JSONL) at `value`, stored as a new input file.

        Raises:
            InvalidRequest / Forbidden: the path is not allowed (app/services/object_store.py),
                or the object does not exist.
            UploadRejected, PayloadTooLarge: as an upload of the same bytes.
            ServiceUnavailable: the store could not be reached.
        """
        path = self._open(principal, value, param)
        with contextlib.closing(self.store.reader(path, param=param)) as body:
            lines = bounded_lines(body, self._settings.max_line_bytes)
            stored = self._files.store_lines(principal, cooperative(lines), str(path))
        return ImportedInput(path, stored)

    def import_items(
        self, principal: Principal, value: str, to_line: ItemToLine, *, param: str
    ) -> ImportedInput:
        """llm-engine's input file (one JSON array of requests) at `value`, each item made
        an input file line by `to_line`.

        Raises: as `import_jsonl`; InvalidRequest when an item is not a JSON object.
        """
        path = self._open(principal, value, param)
        with contextlib.closing(self.store.reader(path, param=param)) as body:
            items = array_items(body, max_item_bytes=self._settings.max_line_bytes, param=param)
            stored = self._files.store_lines(
                principal, cooperative(item_lines(items, to_line, param)), str(path)
            )
        return ImportedInput(path, stored)


def item_lines(items: Iterator[bytes], to_line: ItemToLine, param: str) -> Iterator[bytes]:
    """Each raw JSON item as an input file line."""
    for number, raw in enumerate(items, start=1):
        try:
            item = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(
                f"{param}: item {number} is not valid JSON ({exc})", param=param, code="invalid_json"
            ) from exc
        if not isinstance(item, dict):
            raise InvalidRequest(
                f"{param}: item {number} is not a JSON object (a chat or completion request)",
                param=param,
                code="invalid_line",
            )
        yield to_line(number, item)


def cooperative(lines: Iterator[bytes]) -> Iterator[bytes]:
    """`lines`, yielding the processor every YIELD_EVERY of them (`time.sleep(0)` is a
    switch under gevent's patched standard library, a GIL release under threads)."""
    for number, line in enumerate(lines, start=1):
        if number % YIELD_EVERY == 0:
            time.sleep(0)
        yield line
