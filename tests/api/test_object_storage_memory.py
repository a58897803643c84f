"""Reads and writes of a 200 MB object stream: the process's memory grows by a bounded
amount (a part, a read buffer), never by the object's size. Against a real S3 API server
(moto's server mode, its own process, so the object's bytes held there are not counted)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from app.services.files import bounded_lines
from app.services.object_store import BucketAccess, ObjectPath, ObjectStore
from tests.s3 import MotoServer

OBJECT_BYTES = 200 * 1024 * 1024
LINE = b'{"custom_id": "x", "body": "' + b"a" * 1000 + b'"}\n'
# What streaming may cost, well under the object's size: a 5 MiB part being sent, boto3's
# buffers, the allocator's slack.
BOUND = 64 * 1024 * 1024


@contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Samples this process's RSS every 20 ms; the list holds the peak growth when done."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], proc.memory_info().rss - base)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join()


def generate() -> Iterator[bytes]:
    block = LINE * 1024  # ~1 MB
    for _ in range(OBJECT_BYTES // len(block)):
        yield block


@pytest.fixture(scope="module")
def store(moto_server: MotoServer) -> ObjectStore:
    moto_server.make_bucket("llmq-big")
    return ObjectStore(BucketAccess.parse("*=llmq-big"), moto_server.client, part_bytes=5 * 1024 * 1024)


def test_a_200_mb_object_is_written_and_read_in_bounded_memory(store: ObjectStore) -> None:
    path = ObjectPath("llmq-big", f"big-{secrets.token_hex(3)}.jsonl")
    store.client()  # built outside the measurement
    with peak_rss_growth() as written, store.writer(path, param="output_data_path") as out:
        out.write_all(generate())
    expected = sum(len(b) for b in generate())
    assert out.bytes_written == expected >= 190 * 1024 * 1024
    assert store.size(path, param="p") == expected
    assert written[0] < BOUND, f"writing grew RSS by {written[0] / 2**20:.0f} MiB"

    lines = total = 0
    with peak_rss_growth() as read:
        body = store.reader(path, param="input_data_path")
        try:
            for raw in bounded_lines(body, 10_000):
                lines += 1
                total += len(raw)
        finally:
            body.close()
    assert total == expected and lines == expected // len(LINE)
    assert read[0] < BOUND, f"reading grew RSS by {read[0] / 2**20:.0f} MiB"
    mib = 2**20
    grew = f"write {written[0] / mib:.1f} MiB, read {read[0] / mib:.1f} MiB"
    print(f"RSS growth for {expected / mib:.0f} MiB: {grew}")
