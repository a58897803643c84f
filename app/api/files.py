"""`/v1/files`: OpenAI Files (upload is multipart; content streams)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request, stream_with_context

from app.api.deps import authenticate, principal, services
from app.errors import InvalidRequest

bp = Blueprint("files", __name__)
bp.before_request(authenticate)


def _limit(default: int) -> int:
    raw = request.args.get("limit", str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidRequest(f"`limit` must be an integer, got {raw!r}", param="limit") from exc


@bp.post("/v1/files")
def upload_file() -> Response:
    s = services()
    # Larger than any other request; werkzeug spools the part to disk, so memory stays flat.
    request.max_content_length = s.settings.max_upload_bytes + 1024 * 1024
    upload = request.files.get("file")
    if upload is None:
        raise InvalidRequest("send the file as the multipart field `file`", param="file")
    purpose = request.form.get("purpose", "")
    created = s.files.upload(principal(), upload.stream, upload.filename or "upload.jsonl", purpose)
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
    response.headers["Content-Disposition"] = f'attachment; filename="{f.filename}"'
    return response


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> Response:
    return jsonify(services().files.delete(principal(), file_id).model_dump())
