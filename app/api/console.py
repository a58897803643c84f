"""`/console/`: the web console, plain HTML, CSS and JavaScript shipped in the package
(app/console/), no build step and nothing from another origin.

The files are public (they hold no data); everything the console shows it reads from the
API with the key the user typed, which the page keeps in the tab's `sessionStorage` and
sends as `Authorization: Bearer`, never in a URL. So every call is the key's tenant's, as
from any other client. Console responses carry a strict Content-Security-Policy: scripts,
styles and connections from this origin only, no inline script or style, no plugins, no
framing, and Trusted Types required, so the page cannot write HTML from strings at all
(it builds elements and sets `textContent`).
"""

from __future__ import annotations

from functools import cache
from hashlib import sha256
from importlib import resources

from flask import Blueprint, Response, request

from app.errors import NotFound

bp = Blueprint("console", __name__)

# name -> media type: the only files served.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "object-src 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidated on every load (ETag), so a new release is picked up at once.
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("app").joinpath("console", name).read_bytes()


def _serve(name: str) -> Response:
    body = _read(name)
    response = Response(body, content_type=ASSETS[name])
    response.set_etag(sha256(body).hexdigest()[:32])
    response.make_conditional(request)
    return response


@bp.get("/console/")
def index() -> Response:
    return _serve("index.html")


@bp.get("/console/<name>")
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"the console has no file {name!r}", param="name")
    return _serve(name)


@bp.after_request
def _secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response
