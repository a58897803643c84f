"""gunicorn's own lines (a worker booted, timed out or died) in llmq's log format.

gunicorn gives its loggers handlers of their own, in a text format of its own; this logger
class (`--logger-class`, see `app.serve`) takes them away so the records reach the root
handler of `app.logs`, JSON with `LLMQ_LOG_JSON` like every other line of the API.
"""

from __future__ import annotations

from typing import Any

from gunicorn import glogging

from app.logs import configure_logging
from app.settings import Settings


class Logger(glogging.Logger):  # type: ignore[misc]
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        # The master process imports no app: its logging starts here (the workers it forks
        # inherit it; `create_app` finds it configured).
        configure_logging(Settings())
        for log in (self.error_log, self.access_log):
            for handler in list(log.handlers):
                log.removeHandler(handler)
            log.propagate = True
