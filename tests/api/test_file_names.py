"""A download's `Content-Disposition` carries a client-chosen file name: escaped per
RFC 6266/5987, so quotes, CR/LF and non-ASCII can neither break nor forge the header."""

from __future__ import annotations

import io
import json
import re
import secrets
from urllib.parse import unquote

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api.files import content_disposition
from tests.helpers import auth

HEADER = re.compile(
    r"""^attachment; filename="(?P<fallback>[\x20-\x7e]*)"; """
    r"""filename\*=UTF-8''(?P<exact>[A-Za-z0-9!#$&+\-.^_`|~%]+)$"""
)

NAMES = [
    'in"put.jsonl',
    'a"; filename="evil.exe',
    "back\\slash.jsonl",
    "line\r\nSet-Cookie: x=1.jsonl",
    "tab\there.jsonl",
    "données-日本.jsonl",
    "emoji-\U0001f600.jsonl",
    "100% done;.jsonl",
]


def parse(header: str) -> tuple[str, str]:
    m = HEADER.match(header)
    assert m, header
    assert '"' not in m["fallback"] and "\\" not in m["fallback"]
    return m["fallback"], unquote(m["exact"], encoding="utf-8")


@pytest.mark.parametrize("name", NAMES)
def test_header_is_well_formed_and_carries_the_exact_name(name: str) -> None:
    fallback, exact = parse(content_disposition(name))
    assert exact == name
    assert len(fallback) == len(name) or not name.isascii()


def test_download_of_a_hostile_name_is_escaped(client: FlaskClient, services) -> None:  # type: ignore[no-untyped-def]
    key = services.keys.create_key(f"tenant-names-{secrets.token_hex(3)}")
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "api-only", "messages": [{"role": "user", "content": "hi"}]},
    }
    up = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode() + b"\n"), "f.jsonl")},
        headers=auth(key),
        content_type="multipart/form-data",
    )
    file_id = up.get_json()["id"]
    for name in NAMES:
        # Names as a raw multipart client could send them; stored as given.
        with services.db.session() as s:
            s.execute(text("UPDATE files SET filename = :n WHERE id = :id"), {"n": name, "id": file_id})
        r = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
        assert r.status_code == 200 and r.get_data() == json.dumps(line).encode() + b"\n", name
        assert parse(r.headers["Content-Disposition"])[1] == name
        assert "Set-Cookie" not in r.headers
