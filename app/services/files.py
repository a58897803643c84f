"""OpenAI Files: batch input files are validated line by line as they stream in and stored
line by line in Postgres; output and error files are generated from job rows when read.

Why Postgres for the bytes: a batch turns an input file into job rows with one
INSERT ... SELECT over its lines (no re-parsing, no per-line round trips), the lines share
the jobs' transactions, backups and tenancy checks, and no API host needs a shared disk.
An input line is kept as uploaded, so downloading the file gives back the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from pydantic import ValidationError
from pydantic_core import from_json
from sqlalchemy import Connection, delete, func, select

from app.db import Database
from app.domain.status import BatchStatus, FilePurpose
from app.errors import Conflict, InvalidRequest, LlmqError, PayloadTooLarge
from app.ids import new_id
from app.models import Batch, File, FileLine
from app.schemas.base import unix_time
from app.schemas.batches import (
    BATCH_ENDPOINTS,
    TEXT_COMPLETIONS_URL,
    BatchInputLine,
    BatchLineError,
    FileDeleted,
    FileList,
    FileObject,
    FileUploadOptions,
    TextBatchInputLine,
)
from app.schemas.plain_line import PlainBatchLine
from app.services.batch_output import DOWNLOAD_PAGE_ROWS, output_lines
from app.services.budgets import tenant_budget
from app.services.completion_contract import CompletionPolicy
from app.services.contract import CounterMemo, RequestPolicy
from app.services.keys import Principal
from app.services.ownership import load_owned
from app.services.pagination import check_limit, newest_first, page_fields
from app.services.parsing import check_depth, decode_json, describe, error_param, parse_model
from app.settings import Settings

log = logging.getLogger("llmq.files")

MAX_REPORTED_ERRORS = 100
DOWNLOAD_PAGE_BYTES = 1 << 20
# The first page is read before the 200 goes out, while other requests wait for the same
# pool: it is kept small so that a burst of downloads reaches its status lines sooner (60 at
# once on a loaded 2-core machine: the last status line after 0.9-1.1 s, was 1.5-1.8 s).
FIRST_PAGE_BYTES = 64 << 10


def page_end(sizes: Sequence[Any], budget: int) -> int | None:
    """The last line number of a download page: `sizes` are (line_no, bytes) of the next
    lines in order; as many as fit in `budget` bytes, and at least the first. None: no lines."""
    if not sizes:
        return None
    last, total = sizes[0][0], 0
    for line_no, size in sizes:
        total += size or 0
        if total > budget and line_no != sizes[0][0]:
            break
        last = line_no
    return int(last)


def primed(lines: Iterator[bytes]) -> Iterator[bytes]:
    """`lines` with its first page already read: that query runs while the request is
    handled, where a full pool is a 503, not a body that breaks after its 200 was sent."""
    first = next(lines, None)

    def rest() -> Iterator[bytes]:
        if first is not None:
            yield first
            yield from lines

    return rest()


class UploadRejected(InvalidRequest):
    """The file has bad lines; each is reported with its number. Nothing was stored."""

    def __init__(self, errors: list[BatchLineError]) -> None:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"line {first.line}: {first.message}{more}", param=first.param, code="invalid_file")
        self.errors = errors

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["errors"] = {"object": "list", "data": [e.model_dump() for e in self.errors]}
        return body


def to_file_object(f: File) -> FileObject:
    return FileObject(
        id=f.id,
        bytes=f.bytes,
        created_at=unix_time(f.created_at) or 0,
        filename=f.filename,
        purpose=f.purpose,
        expires_at=unix_time(f.expires_at),
    )


_TEXT_URL = f'"{TEXT_COMPLETIONS_URL}"'.encode()


# Lines the plain shape did not fit before an upload stops trying it (a file of another
# shape pays this many failed attempts, about 5 µs each, and no more).
PLAIN_MISSES = 32


class LineChecker:
    """Validates input lines one at a time, remembering custom_ids to catch repeats.
    `exact_tokens`: each line's prompt counted with the model's tokenizer where the API has
    it (about 0.1 ms a line), else estimated (`budget_tokens`). Without it, a line of the
    plain shape (app/schemas/plain_line.py) is accepted by the plain model and checks, in
    about half the time; any other line, and any the plain checks do not pass, takes the
    full ones. `plain`: off, every line takes the full check (the tests compare)."""

    def __init__(
        self,
        policy: RequestPolicy,
        *,
        completion_policy: CompletionPolicy | None = None,
        max_depth: int = 64,
        exact_tokens: bool = True,
        plain: bool = True,
    ) -> None:
        self._policy = policy
        self._completion_policy = completion_policy
        self._max_depth = max_depth
        self._exact = exact_tokens
        # Counting with the tokenizer needs the full request: those uploads start with the
        # plain shape's tries used up.
        self._plain_misses = 0 if plain and not exact_tokens else PLAIN_MISSES
        self._seen: set[str] = set()
        self._counters: CounterMemo = {}
        self.endpoints: set[str] = set()

    def check(self, number: int, raw: bytes) -> tuple[str, str, int]:
        """(custom_id, text, tokens against the batch token budget) of a valid line. Raises
        LlmqError naming what is wrong."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"not valid UTF-8 at byte {exc.start}", code="invalid_utf8") from exc
        if self._plain_misses < PLAIN_MISSES and (accepted := self._plain(text)) is not None:
            return accepted
        return self._full(raw, text)

    def _plain(self, text: str) -> tuple[str, str, int] | None:
        """The line accepted as the plain shape, or None: the full check decides. No plain
        field takes NaN or Infinity (jiter reads them; each number has bounds), so the
        full check's look for them is not needed here (tests/unit/test_plain_line.py
        probes every plain field with them)."""
        try:
            line = PlainBatchLine.model_validate_json(text)
        except ValidationError:
            self._plain_misses += 1
            return None
        custom_id = line.custom_id
        if "\x00" in custom_id or custom_id in self._seen:
            return None
        tokens = self._policy.plain_line_tokens(line.body, self._counters)
        if tokens is None:
            return None
        self._seen.add(custom_id)
        self.endpoints.add(line.url)
        return custom_id, text, tokens

    def _full(self, raw: bytes, text: str) -> tuple[str, str, int]:
        try:
            line: BatchInputLine | TextBatchInputLine = self._line_model(raw).model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            kind = str(first.get("type"))
            if kind == "json_invalid":
                raise self._unparseable(raw, first) from exc
            if kind == "model_type":
                raise InvalidRequest("each line must be a JSON object", code="invalid_line") from exc
            raise InvalidRequest(
                describe(dict(first)), param=error_param(tuple(first.get("loc", ()))), code=kind
            ) from exc
        # jiter accepts NaN and Infinity, which are not JSON: creating the batch casts each
        # line to Postgres json, which refuses them.
        if (b"NaN" in raw or b"Infinity" in raw) and (named := self._strict_error(raw)) is not None:
            raise named
        if line.url not in BATCH_ENDPOINTS:
            raise InvalidRequest(
                f"url {line.url!r} is not a supported endpoint ({', '.join(BATCH_ENDPOINTS)})",
                param="url",
                code="invalid_url",
            )
        if line.body.stream:
            raise InvalidRequest(
                "`stream: true` cannot be used in a batch", param="body.stream", code="invalid_line"
            )
        if "\x00" in line.custom_id:
            # Stored as Postgres text, which cannot hold U+0000.
            raise InvalidRequest(
                "custom_id holds a NUL character (U+0000)", param="custom_id", code="invalid_custom_id"
            )
        if line.custom_id in self._seen:
            raise InvalidRequest(
                f"custom_id {line.custom_id!r} is used twice", param="custom_id", code="duplicate_custom_id"
            )
        try:
            # The same bounds as a single job; a prompt over the context only fails its own line.
            if isinstance(line, TextBatchInputLine):
                assert self._completion_policy is not None  # _line_model picks it only then
                self._completion_policy.check(line.body, count_tokens=False)
                tokens = self._completion_policy.budget_tokens(line.body, self._counters, exact=self._exact)
            else:
                self._policy.check(line.body, count_tokens=False)
                tokens = self._policy.budget_tokens(line.body, self._counters, exact=self._exact)
        except LlmqError as exc:
            raise InvalidRequest(
                exc.message, param=f"body.{exc.param}" if exc.param else "body", code=exc.code
            ) from exc
        self._seen.add(line.custom_id)
        self.endpoints.add(line.url)
        return line.custom_id, text, tokens

    def _line_model(self, raw: bytes) -> type[BatchInputLine] | type[TextBatchInputLine]:
        """A `/v1/completions` line's body is a text completion; every other line's a chat
        request. Only a line that holds that url at all pays a second parse to tell."""
        if self._completion_policy is None or _TEXT_URL not in raw:
            return BatchInputLine
        try:
            parsed = from_json(raw)
        except ValueError:
            return BatchInputLine  # reported, with its column, by the line model's own parse
        url = parsed.get("url") if isinstance(parsed, dict) else None
        return TextBatchInputLine if url == TEXT_COMPLETIONS_URL else BatchInputLine

    def _strict_error(self, raw: bytes) -> InvalidRequest | None:
        """What the request body parser says about the line, naming the field that holds a
        lone surrogate, an out-of-range number or NaN/Infinity. Slower than jiter, so only
        run when jiter refused the line or the line holds one of those literals."""
        try:
            check_depth(raw, self._max_depth)
            decode_json(raw)
        except InvalidRequest as exc:
            if exc.code != "invalid_json":
                return InvalidRequest(exc.message, param=exc.param, code="invalid_json")
        return None

    def _unparseable(self, raw: bytes, first: Any) -> InvalidRequest:
        """The error for a line the fast parser refused: the named field when the strict
        parser finds one, else jiter's own reason, with its column."""
        named = self._strict_error(raw)
        if named is not None:
            return named
        detail = str((first.get("ctx") or {}).get("error", "")).replace(" at line 1 ", " at ")
        return InvalidRequest(
            f"not valid JSON: {detail}" if detail else "not valid JSON", code="invalid_json"
        )


def bounded_lines(stream: IO[bytes], limit: int) -> Iterator[bytes]:
    """The stream's lines, none read whole past `limit` bytes (a one-line file of 199 MB
    must not sit in memory to be refused).

    Raises:
        PayloadTooLarge: naming the first line over `limit` bytes.
    """
    number = 0
    while raw := stream.readline(limit + 2):  # room for the line's own "\r\n"
        number += 1
        if len(raw.rstrip(b"\r\n")) > limit:
            raise PayloadTooLarge(
                f"line {number} is over {limit} bytes, the limit for one line (LLMQ_MAX_LINE_BYTES)",
                param="file",
                code="line_too_large",
            )
        yield raw


class FileService:
    def __init__(
        self,
        db: Database,
        policy: RequestPolicy,
        settings: Settings,
        *,
        completion_policy: CompletionPolicy | None = None,
    ) -> None:
        self._db = db
        self._policy = policy
        self._completion_policy = completion_policy
        self._settings = settings

    def upload(
        self,
        principal: Principal,
        stream: IO[bytes],
        filename: str,
        purpose: str,
        *,
        options: dict[str, Any] | None = None,
    ) -> FileObject:
        """Read, check and store an input file line by line (bounded memory). `options`:
        the form's other fields (`expires_after`: the file is deleted that long after
        its upload, by the workers' expiry task).

        Raises:
            InvalidRequest: wrong purpose, a bad `expires_after`.
            UploadRejected: bad lines, every one reported with its number; nothing stored.
            PayloadTooLarge: over the line or byte limit.
        """
        if purpose != FilePurpose.BATCH.value:
            raise InvalidRequest(f"purpose {purpose!r} is not accepted; use 'batch'", param="purpose")
        if "\x00" in filename:
            raise InvalidRequest("the file name holds a NUL character (U+0000)", param="file")
        expiry = parse_model(FileUploadOptions, options or {}).expires_after
        lines = bounded_lines(stream, self._settings.max_line_bytes)
        return self.store_lines(
            principal, lines, filename, purpose, expires_in=expiry.seconds if expiry else None
        )

    def store_lines(
        self,
        principal: Principal,
        raw_lines: Iterable[bytes],
        filename: str,
        purpose: str = FilePurpose.BATCH.value,
        *,
        expires_in: int | None = None,
    ) -> FileObject:
        """Check and store an input file given as its lines (each at most
        LLMQ_MAX_LINE_BYTES, as `bounded_lines` yields them), consumed one at a time.

        Raises:
            UploadRejected: bad lines, every one reported with its number; nothing stored.
            PayloadTooLarge: over the byte or line limit.
        """
        checker = LineChecker(
            self._policy,
            completion_policy=self._completion_policy,
            max_depth=self._settings.max_json_depth,
            exact_tokens=self._budgeted(principal.tenant_id),
        )
        file_id = new_id("file")
        created = datetime.now(UTC)
        expires = created + timedelta(seconds=expires_in) if expires_in is not None else None
        errors: list[BatchLineError] = []
        total = lines = 0
        raw_conn: Any = self._db.engine.raw_connection()
        try:
            conn = raw_conn.driver_connection
            with conn.transaction():
                conn.execute(
                    "INSERT INTO files (id, tenant_id, purpose, filename, bytes, line_count, created_at, "
                    "expires_at) VALUES (%s, %s, %s, %s, 0, 0, %s, %s)",
                    (file_id, principal.tenant_id, purpose, filename, created, expires),
                )
                with conn.cursor().copy(
                    "COPY file_lines (file_id, line_no, custom_id, raw, tokens) FROM STDIN"
                ) as copy:
                    for number, raw in enumerate(raw_lines, start=1):
                        total += len(raw)
                        if total > self._settings.max_upload_bytes:
                            raise PayloadTooLarge(f"the file is over {self._settings.max_upload_bytes} bytes")
                        line = raw.rstrip(b"\r\n")
                        if not line.strip():
                            continue
                        lines += 1
                        if lines > self._settings.max_batch_lines:
                            raise PayloadTooLarge(
                                f"the file has more than {self._settings.max_batch_lines} lines"
                            )
                        try:
                            custom_id, text, tokens = checker.check(number, line)
                        except LlmqError as exc:
                            errors.append(
                                BatchLineError(
                                    code=exc.code or "invalid_line",
                                    message=exc.message,
                                    param=exc.param,
                                    line=number,
                                )
                            )
                            if len(errors) >= MAX_REPORTED_ERRORS:
                                break
                            continue
                        if not errors:
                            copy.write_row((file_id, number, custom_id, text, tokens))
                    if errors:
                        raise UploadRejected(errors)
                    if lines == 0:
                        raise InvalidRequest("the file has no lines", param="file")
                conn.execute(
                    "UPDATE files SET bytes = %s, line_count = %s WHERE id = %s", (total, lines, file_id)
                )
        finally:
            raw_conn.close()
        log.info(
            "file uploaded",
            extra={"file_id": file_id, "lines": lines, "bytes": total, "tenant": principal.tenant_id},
        )
        return FileObject(
            id=file_id,
            bytes=total,
            created_at=unix_time(created) or 0,
            filename=filename,
            purpose=purpose,
            expires_at=unix_time(expires),
        )

    def _budgeted(self, tenant_id: str) -> bool:
        """Whether the tenant has a batch token budget now: only then are a file's prompts
        counted with the model's tokenizer, which takes most of an upload's time (B4's
        50,000 short lines, the tiny model served: 6.5 s against 1.1). Without one, a line's
        figure is the estimate, and a budget set later counts this file's lines by it."""
        with self._db.reading() as s:
            return tenant_budget(s, tenant_id, self._settings.batch_token_budget) > 0

    def get(self, principal: Principal, file_id: str) -> File:
        with self._db.reading() as s:
            return load_owned(s, File, file_id, principal.tenant_id)

    def list(self, principal: Principal, *, purpose: str | None, after: str | None, limit: int) -> FileList:
        check_limit(limit, 10_000)
        q = select(File).where(File.tenant_id == principal.tenant_id)
        if purpose:
            q = q.where(File.purpose == purpose)
        with self._db.reading() as s:
            rows, more = newest_first(s, q, File.id, after=after, limit=limit)
        data = [to_file_object(f) for f in rows]
        return FileList(data=data, **page_fields(data, more))

    def delete(self, principal: Principal, file_id: str) -> FileDeleted:
        """Raises:
        NotFound: no such file for this tenant.
        Conflict: a batch still running reads it.
        """
        self.get(principal, file_id)
        with self._db.session() as s:
            busy = s.scalar(
                select(func.count())
                .select_from(Batch)
                .where(
                    Batch.input_file_id == file_id,
                    Batch.status.in_(
                        [
                            BatchStatus.VALIDATING.value,
                            BatchStatus.IN_PROGRESS.value,
                            BatchStatus.CANCELLING.value,
                        ]
                    ),
                )
            )
            if busy:
                raise Conflict(
                    f"file {file_id} is the input of a running batch", param="file_id", code="file_in_use"
                )
            s.execute(delete(FileLine).where(FileLine.file_id == file_id))
            s.execute(delete(File).where(File.id == file_id))
        return FileDeleted(id=file_id, deleted=True)

    def content(self, principal: Principal, file_id: str) -> tuple[File, Iterator[bytes]]:
        """The file's bytes, streamed: an input file as uploaded, an output or error file
        generated from its batch's job rows. Raises NotFound for another tenant's file."""
        # One connection for the file's row and the first page: under a burst of downloads
        # each request waits for the pool once, not twice.
        with self._db.reading() as s:
            f = load_owned(s, File, file_id, principal.tenant_id)
            on = s.connection()
            if f.batch_id is not None and f.batch_part is not None:
                return f, primed(output_lines(self._db, f.batch_id, f.batch_part, first_on=on))
            return f, primed(self.input_lines(file_id, first_on=on))

    def input_lines(
        self,
        file_id: str,
        *,
        page: int = DOWNLOAD_PAGE_ROWS,
        page_bytes: int = DOWNLOAD_PAGE_BYTES,
        first_page_bytes: int = FIRST_PAGE_BYTES,
        first_on: Connection | None = None,
    ) -> Iterator[bytes]:
        """The file as uploaded, a line at a time, read from Postgres in pages of at most
        `page` lines and about `page_bytes` (`first_page_bytes` for the first; always at
        least one line, which may be up to the 32 MiB line bound). Each page is its own short
        query (keyset on the line number), so a client that reads slowly, or not at all, holds
        no pooled connection between pages and an API process holds one page of each download
        in memory, not a thousand huge lines. `first_on`: a connection the caller holds, for
        the first page only (`Database.page`)."""
        after = 0
        while True:
            in_order = (FileLine.file_id == file_id, FileLine.line_no > after)
            first = after == 0
            with self._db.page(first=first, on=first_on) as conn:
                # Sizes first: octet_length reads the stored length, not the (TOASTed) text.
                sizes = conn.execute(
                    select(FileLine.line_no, func.octet_length(FileLine.raw))
                    .where(*in_order)
                    .order_by(FileLine.line_no)
                    .limit(page)
                ).all()
                last = page_end(sizes, first_page_bytes if first else page_bytes)
                if last is None:
                    return
                rows = conn.execute(
                    select(FileLine.raw).where(*in_order, FileLine.line_no <= last).order_by(FileLine.line_no)
                ).all()
            for (raw,) in rows:
                yield raw.encode("utf-8") + b"\n"
            if len(sizes) < page and last == sizes[-1][0]:
                return
            after = last
