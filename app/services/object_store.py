"""Batch inputs and outputs in one S3-compatible object store.

Only `s3://bucket/key` paths are accepted, on the one store boto3 is configured for (the
standard `AWS_*` variables; `AWS_ENDPOINT_URL_S3` names a store that is not AWS), and only
in the buckets `LLMQ_S3_BUCKETS` allows the caller's tenant. Nothing else is ever
contacted: no `file://`, no `http(s)://` URL, no other host. Tenants are named by their id
(which is the name `llmq keys create` was given).

Reads stream (a buffered reader over the response body) and writes go up as a multipart
upload of `part_bytes` parts, so a 200 MB object never sits in memory.
"""

from __future__ import annotations

import io
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from app.errors import Forbidden, InvalidRequest, LlmqError, ServiceUnavailable

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("llmq.objects")

SCHEME = "s3://"
EVERY_TENANT = "*"
# S3's bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, starting and
# ending with a letter or digit. A name outside them cannot be in LLMQ_S3_BUCKETS anyway.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_KEY_BYTES = 1024
READ_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ObjectPath:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def is_object_path(value: str) -> bool:
    """Whether `value` is meant as an object path rather than an llmq file id."""
    return "://" in value


def _split(value: str, param: str) -> ObjectPath:
    """Scheme and bucket checked, the key not yet: a bucket not allowed is a 403 whatever
    the key (app/schemas/batches.py's OBJECT_PATH_PATTERN says the same to clients)."""
    if not value.startswith(SCHEME):
        scheme = value.split("://", 1)[0] + "://" if "://" in value else "a plain path"
        raise InvalidRequest(
            f"{param} {value!r} is not reachable: only s3://bucket/key paths on the configured "
            f"object store are (not {scheme})",
            param=param,
            code="unsupported_path",
        )
    bucket, _, key = value[len(SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise InvalidRequest(
            f"{param} {value!r} does not name a valid bucket", param=param, code="invalid_path"
        )
    return ObjectPath(bucket, key)


def _check_key(path: ObjectPath, param: str) -> ObjectPath:
    if not path.key or len(path.key.encode("utf-8")) > MAX_KEY_BYTES or "\x00" in path.key:
        raise InvalidRequest(
            f"{param} {str(path)!r} needs an object key of 1 to {MAX_KEY_BYTES} bytes after the bucket",
            param=param,
            code="invalid_path",
        )
    return path


def parse_path(value: str, *, param: str) -> ObjectPath:
    """`s3://bucket/key`, checked.

    Raises:
        InvalidRequest: another scheme (file://, http://, ...), or no valid bucket or key.
    """
    return _check_key(_split(value, param), param)


@dataclass(frozen=True)
class BucketAccess:
    """Which buckets each tenant may use (LLMQ_S3_BUCKETS)."""

    by_tenant: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> BucketAccess:
        """`tenant=bucket[,bucket];tenant=...`; `*` as the tenant applies to every tenant.

        Raises:
            ValueError: an entry without `=`, a tenant or bucket name missing or invalid.
        """
        found: dict[str, set[str]] = {}
        for entry in (e.strip() for e in spec.split(";")):
            if not entry:
                continue
            tenant, sep, buckets = entry.partition("=")
            names = [b.strip() for b in buckets.split(",") if b.strip()]
            if not sep or not tenant.strip() or not names:
                raise ValueError(f"LLMQ_S3_BUCKETS entry {entry!r} is not tenant=bucket[,bucket]")
            bad = [b for b in names if not _BUCKET.fullmatch(b)]
            if bad:
                raise ValueError(f"LLMQ_S3_BUCKETS names an invalid bucket {bad[0]!r}")
            found.setdefault(tenant.strip(), set()).update(names)
        return cls({t: frozenset(b) for t, b in found.items()})

    def allows(self, tenant_id: str, bucket: str) -> bool:
        return bucket in self.by_tenant.get(tenant_id, frozenset()) or bucket in self.by_tenant.get(
            EVERY_TENANT, frozenset()
        )


class _BodyReader(io.RawIOBase):
    """A boto3 response body as a raw stream, for io.BufferedReader (readline, bounded reads)."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


class MultipartWriter:
    """Writes one object as a multipart upload: bytes are gathered into parts of
    `part_bytes` and each is sent as it fills, so memory holds one part. Leaving the
    `with` block completes the upload; an exception aborts it (no partial object)."""

    def __init__(self, client: Any, path: ObjectPath, part_bytes: int, errors: Callable[..., LlmqError]):
        self._client = client
        self._path = path
        self._part_bytes = part_bytes
        self._errors = errors
        self._buffer = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self.bytes_written = 0

    def __enter__(self) -> MultipartWriter:
        try:
            made = self._client.create_multipart_upload(Bucket=self._path.bucket, Key=self._path.key)
        except Exception as exc:
            raise self._errors(exc) from exc
        self._upload_id = made["UploadId"]
        return self

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.bytes_written += len(data)
        while len(self._buffer) >= self._part_bytes:
            part = bytes(self._buffer[: self._part_bytes])
            del self._buffer[: self._part_bytes]
            self._send(part)

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _send(self, part: bytes) -> None:
        number = len(self._parts) + 1
        try:
            sent = self._client.upload_part(
                Bucket=self._path.bucket,
                Key=self._path.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=part,
            )
        except Exception as exc:
            raise self._errors(exc) from exc
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            try:
                self._client.abort_multipart_upload(
                    Bucket=self._path.bucket, Key=self._path.key, UploadId=self._upload_id
                )
            except Exception:  # the error being raised matters more than a failed abort
                log.warning("multipart upload not aborted", extra={"path": str(self._path)}, exc_info=True)
            return
        if self._buffer or not self._parts:  # the last part may be short; an empty object has one
            self._send(bytes(self._buffer))
            self._buffer.clear()
        try:
            self._client.complete_multipart_upload(
                Bucket=self._path.bucket,
                Key=self._path.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        except Exception as exc:
            raise self._errors(exc) from exc


def default_client() -> Any:
    """An S3 client configured by the environment, as boto3 always is (credentials, region,
    AWS_ENDPOINT_URL_S3). Imported here so the API without object storage never loads boto3."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 4, "mode": "standard"}),
    )


class ObjectStore:
    """`client_factory`: builds the S3 client on first use (boto3 clients are thread-safe,
    so one is shared)."""

    def __init__(
        self,
        access: BucketAccess,
        client_factory: Callable[[], Any] = default_client,
        *,
        part_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self._access = access
        self._factory = client_factory
        self._client: Any = None
        self._lock = threading.Lock()
        self.part_bytes = part_bytes

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def resolve(self, tenant_id: str, value: str, *, param: str) -> ObjectPath:
        """The path, if this tenant may use it.

        Raises:
            InvalidRequest: not an s3://bucket/key path.
            Forbidden: the bucket is not one LLMQ_S3_BUCKETS allows this tenant.
        """
        path = _split(value, param)
        if not self._access.allows(tenant_id, path.bucket):
            raise Forbidden(
                f"{param} {value!r}: bucket {path.bucket!r} is not allowed for this tenant (LLMQ_S3_BUCKETS)",
                param=param,
                code="bucket_not_allowed",
            )
        return _check_key(path, param)

    def size(self, path: ObjectPath, *, param: str) -> int:
        """The object's size in bytes.

        Raises:
            InvalidRequest: no such object (code `object_not_found`).
            Forbidden: the store refused access.
            ServiceUnavailable: the store could not be reached.
        """
        try:
            head = self.client().head_object(Bucket=path.bucket, Key=path.key)
        except Exception as exc:
            raise store_error(exc, path, param) from exc
        return int(head["ContentLength"])

    def reader(self, path: ObjectPath, *, param: str) -> IO[bytes]:
        """The object's bytes as a buffered stream read from the store as it is consumed
        (READ_CHUNK_BYTES at a time). Close it when done.

        Raises: as `size`.
        """
        try:
            body = self.client().get_object(Bucket=path.bucket, Key=path.key)["Body"]
        except Exception as exc:
            raise store_error(exc, path, param) from exc
        return io.BufferedReader(_BodyReader(body), buffer_size=READ_CHUNK_BYTES)

    def writer(self, path: ObjectPath, *, param: str) -> MultipartWriter:
        return MultipartWriter(
            self.client(), path, self.part_bytes, lambda exc: store_error(exc, path, param)
        )


def store_error(exc: Exception, path: ObjectPath, param: str) -> LlmqError:
    """A boto3 failure as the error the caller sees, naming the path."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, LlmqError):
        return exc
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
            return InvalidRequest(f"{param} {path} does not exist", param=param, code="object_not_found")
        if code in ("403", "AccessDenied", "Forbidden", "AllAccessDisabled"):
            return Forbidden(
                f"{param} {path}: the object store refused access", param=param, code="access_denied"
            )
        return ServiceUnavailable(f"{param} {path}: the object store answered {code}", param=param)
    if isinstance(exc, BotoCoreError):
        return ServiceUnavailable(
            f"{param} {path}: the object store could not be reached ({exc})", param=param
        )
    return ServiceUnavailable(f"{param} {path}: {type(exc).__name__}", param=param)


def store_from_settings(settings: Settings, client: Callable[[], Any] | None = None) -> ObjectStore:
    """The one S3-compatible store (boto3's own configuration unless `client` builds one),
    with the buckets each tenant may use."""
    return ObjectStore(
        BucketAccess.parse(settings.s3_buckets), client or default_client, part_bytes=settings.s3_part_bytes
    )
