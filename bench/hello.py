"""The hello-world baseline of B3 and B6: one JSON endpoint, served by the same gunicorn
setup as the API (app/serve.py: gevent workers, same worker count)."""

from __future__ import annotations

from flask import Flask, jsonify
from flask.typing import ResponseReturnValue


def create_app() -> Flask:
    app = Flask("hello")

    @app.route("/hello", methods=["GET", "POST"])
    def hello() -> ResponseReturnValue:
        return jsonify({"object": "hello", "ok": True})

    return app
