"""`/v1/files`: OpenAI Files (upload is multipart; content streams)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from flask import Blueprint, Response, jsonify, request, stream_with_context

from app.api.deps import authenticate, principal, services
from app.errors import InvalidRequest

bp = Blueprint("files", __name__)
bp.before_request(authenticate)


def content_disposition(filename: str) -> str:
    """An `attachment` header for a client-chosen name (RFC 6266): a quoted ASCII fallback in
    which quotes, backslashes, control characters (CR/LF would split the header) and
    non-ASCII become `_`, and the exact name as RFC 5987 `filename*=UTF-8''...`."""
    fallback = "".join(c if 0x20 <= ord(c) < 0x7F and c not in '"\\' else "_" for c in filename)
    exact = quote(filename.encode("utf-8", "replace"), safe="!#$&+^`|")
    return f"attachment; filename=\"{fallback or 'download'}\"; filename*=UTF-8''{exact}"


def _limit(default: int) -> int:
    raw = request.args.get("limit", str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidRequest(f"`limit` must be an integer, got {raw!r}", param="limit") from exc


def _upload_options() -> dict[str, Any]:
    """The form's `expires_after`: as the OpenAI SDKs send it (`expires_after[anchor]`,
    `expires_after[seconds]`), or as one JSON field."""
    form = request.form
    if "expires_after" in form:
        try:
            return {"expires_after": json.loads(form["expires_after"])}
        except ValueError as exc:
            raise InvalidRequest("expires_after must be a JSON object", param="expires_after") from exc
    prefix = "expires_after["
    fields = {k[len(prefix) : -1]: v for k, v in form.items() if isinstance(k, str) and k.startswith(prefix)}
    return {"expires_after": fields} if fields else {}


@bp.post("/v1/files")
def upload_file() -> Response:
    s = services()
    # Larger than any other request; werkzeug spools the part to disk, so memory stays flat.
    request.max_content_length = s.settings.max_upload_bytes + 1024 * 1024
    upload = request.files.get("file")
    if upload is None:
        raise InvalidRequest("send the file as the multipart field `file`", param="file")
    purpose = request.form.get("purpose", "")
    created = s.files.upload(
        principal(), upload.stream, upload.filename or "upload.jsonl", purpose, options=_upload_options()
    )
    return jsonify(created.model_dump())


@bp.get("/v1/files")
def list_files() -> Response:
    page = services().files.list(
        principal(),
        purpose=request.args.get("purpose"),
        after=request.args.get("after"),
        limit=_limit(10_000),
    )
    return jsonify(page.model_dump())


@bp.get("/v1/files/<file_id>")
def get_file(file_id: str) -> Response:
    from app.services.files import to_file_object

    return jsonify(to_file_object(services().files.get(principal(), file_id)).model_dump())


@bp.get("/v1/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    s = services()
    slot = s.slots.acquire(principal().key_id)
    with s.slots.released_on_error(slot):
        f, lines = s.files.content(principal(), file_id)
    body = s.slots.attach(slot, lines)
    response = Response(stream_with_context(body), mimetype="application/jsonl")
    response.headers["Content-Disposition"] = content_disposition(f.filename)
    return response


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> Response:
    return jsonify(services().files.delete(principal(), file_id).model_dump())
