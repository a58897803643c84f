"""Redis keys and channels for job events, shared by the API and the worker.

- `llmq:cancel`          pub/sub: job ids whose cancel was requested (workers listen)
- `llmq:job:<id>`        pub/sub: notification that the job's event log grew or ended
- `llmq:events:<id>`     Redis Stream: the job's replayable event log (chunks, end)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from redis import Redis

CANCEL_CHANNEL = "llmq:cancel"
END_EVENT = "end"


def job_channel(job_id: str) -> str:
    return f"llmq:job:{job_id}"


def job_stream(job_id: str) -> str:
    return f"llmq:events:{job_id}"


class JobEvents:
    """Publishing and waiting on job notifications."""

    def __init__(self, redis: Redis[bytes]) -> None:
        self._redis = redis

    def request_cancel(self, job_id: str) -> None:
        self._redis.publish(CANCEL_CHANNEL, job_id)

    def publish_end(self, job_id: str, status: str) -> None:
        self._redis.publish(job_channel(job_id), json.dumps({"type": END_EVENT, "status": status}))

    def wait_for_end(self, job_id: str, is_done: Callable[[], bool], timeout: float) -> bool:
        """Block until the job ends or `timeout` seconds pass; True if it ended.

        Subscribes first, then asks `is_done` (Postgres), so an end published between
        the two is never missed.
        """
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(job_channel(job_id))
            if is_done():
                return True
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                message = pubsub.get_message(timeout=min(left, 1.0))
                if message is not None and _is_end(message.get("data")):
                    return True
            return is_done()
        finally:
            pubsub.close()


def _is_end(data: Any) -> bool:
    try:
        return bool(json.loads(data).get("type") == END_EVENT)
    except (TypeError, ValueError, AttributeError):
        return False
