"""The benchmark tooling that every figure rests on: CPU accounting by process group from
/proc, the closed-loop load generator, the burst sender, the SSE client, the B3
sustained-rate rule, and the report (table and one PNG per curve)."""

from __future__ import annotations

import asyncio
import gc
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import b3_submit, cpu, load, report, sse

# Waits for a line, burns `s` seconds of CPU, then waits for the end of its input.
BURN = (
    "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
    "while time.process_time() - t < {s}: pass\nsys.stdin.read()"
)


def _measured_burn(proc: subprocess.Popen[bytes], group: str) -> cpu.CpuUse:
    """`cpu.measure` over the stretch in which `proc` (as `group`) burns its CPU."""
    assert proc.stdin is not None
    stack: Any = SimpleNamespace(procs={group: proc}, servers=[])
    with cpu.measure(stack) as use:
        start = cpu.own_process_seconds([proc.pid])
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        # /proc counts user and system time apart, each in whole clock ticks: the sum can
        # read up to two ticks short of what the child burnt (waiting for all 0.4 s once
        # hung the suite), so wait for 0.3 s of it, and not forever.
        deadline = time.monotonic() + 30
        while cpu.own_process_seconds([proc.pid]) < start + 0.3:
            assert time.monotonic() < deadline, "the child never burnt its CPU"
            time.sleep(0.01)
    return use


def test_cpu_use_is_counted_for_the_group_that_spent_it() -> None:
    """A child that burns 0.4 s of CPU inside the measured stretch is charged to its group
    (here "api"), and nothing to the groups with no process."""
    proc = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.4)], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        use = _measured_burn(proc, "api")
    finally:
        proc.communicate(b"")
    assert use.seconds["api"] >= 0.2
    assert use.seconds["worker"] == use.seconds["engine"] == 0.0
    assert use.per_unit_ms(100)["api"] >= 2.0


# Names a thread of its own (app/threads.py), waits for a line, burns `s` seconds of CPU on
# it, then waits for the end of its input.
BURN_ON_THREAD = (
    "import sys, threading, time\n"
    "from app.threads import name_native_thread\n"
    "def burn():\n"
    "    name_native_thread('llmq-burner')\n"
    "    sys.stdin.readline()\n"
    "    t = time.thread_time()\n"
    "    while time.thread_time() - t < {s}: pass\n"
    "th = threading.Thread(target=burn)\nth.start()\nth.join()\nsys.stdin.read()"
)


def test_the_worker_process_cpu_is_cut_by_thread_name() -> None:
    """A worker thread named natively that burns 0.4 s inside the measured stretch is
    charged to its name; the main thread, which only waits, to `main` at most a little."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", BURN_ON_THREAD.format(s=0.4)],
        stdin=subprocess.PIPE,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    try:
        deadline = time.monotonic() + 30
        while not any(name == "llmq-burner" for name, _ in cpu.thread_seconds(proc.pid).values()):
            assert time.monotonic() < deadline, "the child never named its thread"
            time.sleep(0.01)
        use = _measured_burn(proc, "worker")
    finally:
        proc.communicate(b"")
    assert use.threads["llmq-burner"] >= 0.2
    assert use.threads.get(cpu.MAIN_THREAD, 0.0) < 0.1
    assert next(iter(use.threads)) == "llmq-burner"  # most first
    assert use.threads_per_unit_ms(100)["llmq-burner"] >= 2.0


@pytest.mark.parametrize("schedstat", [True, False], ids=["schedstat", "stat-ticks"])
def test_threads_are_read_by_kernel_name_and_summed_per_name(tmp_path: Path, schedstat: bool) -> None:
    """Names with spaces and parentheses are read whole; threads of one name are summed;
    a thread born inside the stretch counts from zero, one gone loses its time. The time is
    `schedstat`'s nanoseconds where the kernel has it, else `stat`'s ticks."""
    tick = os.sysconf("SC_CLK_TCK")

    def write(tid: int, name: str, ticks: tuple[int, int]) -> None:
        d = tmp_path / "40" / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        if schedstat:
            nanoseconds = (ticks[0] + ticks[1]) * 10**9 // tick
            (d / "schedstat").write_text(f"{nanoseconds} 12345 67\n")
            ticks = (0, 0)  # what a test of `stat` would read is not what counts
        rest = " ".join(["S", *["0"] * 10, str(ticks[0]), str(ticks[1]), "0", "0"])
        (d / "stat").write_text(f"{tid} ({name}) {rest}\n")

    write(40, "celeryd: llmq-4", (10, 5))
    write(41, "llmq-task", (1, 0))
    write(42, "llmq-task", (2, 0))
    write(43, "odd (name) x", (0, 0))
    before = cpu.thread_seconds(40, tmp_path)
    assert before[40][0] == cpu.MAIN_THREAD and before[43][0] == "odd (name) x"
    write(40, "celeryd: llmq-4", (10, 5 + tick))  # main: 1 s of system time
    write(41, "llmq-task", (1 + tick, 0))  # 1 s
    write(42, "llmq-task", (2 + 2 * tick, 0))  # 2 s
    write(44, "llmq-task", (tick, 0))  # born inside: 1 s
    shutil.rmtree(tmp_path / "40" / "task" / "43")
    spent = cpu.by_thread_name(before, cpu.thread_seconds(40, tmp_path))
    assert spent == {"llmq-task": 4.0, cpu.MAIN_THREAD: 1.0}
    assert cpu.thread_seconds(99, tmp_path) == {}


def test_the_report_shows_the_worker_by_thread_after_the_processes() -> None:
    line = report.cpu_line(
        {
            "cpu_ms_per_job": {"api": 4.5, "worker": 17.2, "redis": 0.0},
            "worker_threads_ms_per_job": {"llmq-engine-loo": 12.7, "llmq-task": 3.1, "llmq-presence": 0.004},
        }
    )
    assert line == "ms/job: api=4.5 worker=17.2; worker by thread: llmq-engine-loo=12.7 llmq-task=3.1"
    assert report.cpu_line({"cpu_ms_per_line": {"worker": 0.46}}) == "ms/line: worker=0.46"


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET /ok answers 200, any other GET 503; a POST answers with its body's number as the
    id, or 503 for the number 13 or another key."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(200 if self.path == "/ok" else 503, b'{"ok": true}')

    def do_POST(self) -> None:
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = sent["n"] != 13 and self.headers["Authorization"] == "Bearer k"
        self._reply(200 if ok else 503, json.dumps({"id": f"job-{sent['n']}"} if ok else {}).encode())

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_the_load_generator_counts_successes_and_errors_apart() -> None:
    with serving() as base:
        ok = load.run(load.request_fn(base, "GET", "/ok"), 2, 0.5, warmup=0.1)
        bad = load.run(load.request_fn(base, "GET", "/down"), 1, 0.3, warmup=0.0)
    assert ok.errors == 0 and len(ok.latencies) > 10 and ok.rate > 0
    assert ok.summary()["p99_ms"] >= ok.summary()["p50_ms"] > 0
    assert bad.errors > 0 and not bad.latencies


def test_a_burst_answers_in_body_order_and_fails_on_a_refused_request() -> None:
    auth = {"Authorization": "Bearer k"}
    with serving() as base:
        answers = load.burst(base, "/v2/jobs", [{"n": n} for n in range(20, 60)], auth, 8)
        with pytest.raises(RuntimeError, match="503"):
            load.burst(base, "/v2/jobs", [{"n": n} for n in range(10, 20)], auth, 4)
        with pytest.raises(RuntimeError, match="503"):
            load.burst(base, "/v2/jobs", [{"n": 1}], {"Authorization": "Bearer wrong"}, 64)
    assert [a["id"] for a in answers] == [f"job-{n}" for n in range(20, 60)]


def test_a_timed_round_holds_no_collection_of_the_timing_process() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = weakref.ref(Cycle())  # only a collection frees it
    with load.no_collections():
        assert garbage() is None  # collected before the round
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with load.no_collections():
            raise RuntimeError("a round that fails")
    except RuntimeError:
        pass
    assert gc.isenabled()


def test_the_sustained_rate_is_the_best_rate_with_p99_under_50_ms() -> None:
    curve = [
        {"clients": 1, "rps": 100.0, "p99_ms": 10.0, "errors": 0},
        {"clients": 4, "rps": 300.0, "p99_ms": 45.0, "errors": 0},
        {"clients": 8, "rps": 500.0, "p99_ms": 80.0, "errors": 0},
        {"clients": 16, "rps": 600.0, "p99_ms": 40.0, "errors": 3},
    ]
    assert b3_submit.sustained(curve)["clients"] == 4
    assert b3_submit.sustained(curve[2:3])["clients"] == 8  # none under: the lowest level


def test_the_report_has_a_row_per_result_and_a_png_per_curve(tmp_path: Path) -> None:
    results = [
        {
            "id": "B2",
            "ms_per_line": 0.5,
            "runs": [{"lines": n, "ms_per_line": 0.5} for n in (10, 100)],
            "cpu_ms_per_line": {"api": 0.1, "worker": 0.3},
            "goal": "<= 0.2",
        },
        {
            "id": "B3",
            "ratio": 0.4,
            "curves": {"llmq": [{"rps": 10.0, "p99_ms": 9.0}], "hello": [{"rps": 90.0, "p99_ms": 1.0}]},
            "goal": ">= 0.5",
        },
        {
            "id": "B5",
            "levels": {
                "n1": {"added_vs_direct_p99_ms": 4.0, "added_ttfc_p99_ms": 5.0, "delivery_lag_p99_ms": 2.0}
            },
            "goal": "x",
        },
        {
            "id": "B10",
            "ratio": 2.0,
            "runs": {
                o: {"generated_tokens_per_s": 9.0, "prefix_cache_hit_rate": 0.5} for o in ("input", "prefix")
            },
            "goal": ">= 1.3",
        },
    ]
    text = report.table(results)
    assert all(f"| {r['id']} |" in text for r in results)
    assert "ms/line: api=0.1 worker=0.3" in text
    made = report.plots(results, tmp_path)
    assert sorted(p.name for p in made) == [
        "b10_prefix_order.png",
        "b2_ms_per_line.png",
        "b3_rate_vs_p99.png",
        "b5_stream_overhead.png",
    ]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in made)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _serve_once(reply: bytes) -> tuple[asyncio.Server, str, list[bytes]]:
    """A server that reads one request (head and body) and writes `reply` raw."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        seen.append(head + await reader.readexactly(length))
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


def test_the_sse_client_reads_events_across_chunk_boundaries() -> None:
    """Each `data:` line is one arrival under the last `id:` before it, a line split over two
    chunks included; `[DONE]` is not an event; the request carries the body and headers."""
    body = _chunked(b'id: 1-1\ndata: {"a"', b": 1}\n\nid: 1-2\ndata: {}\n\n", b"data: [DONE]\n\n")
    reply = b"HTTP/1.1 200 OK\r\nX-Llmq-Job-Id: job-7\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    async def go() -> tuple[sse.Stream, list[bytes]]:
        server, url, seen = await _serve_once(reply)
        async with server:
            conn = await sse.Connection.open(url)
            return await conn.post_stream(
                "/v1/chat/completions", {"x": 1}, {"Authorization": "Bearer k"}
            ), seen

    got, seen = asyncio.run(go())
    assert got.status == 200 and got.headers["x-llmq-job-id"] == "job-7"
    assert [event_id for event_id, _ in got.arrivals] == ["1-1", "1-2"]
    assert all(got.sent <= at for _, at in got.arrivals)
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in seen[0] and seen[0].endswith(b'{"x": 1}')


def test_the_sse_client_keeps_a_refusals_body() -> None:
    reply = b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 13\r\n\r\n{"error": {}}'

    async def go() -> sse.Stream:
        server, url, _ = await _serve_once(reply)
        async with server:
            return await (await sse.Connection.open(url)).post_stream("/s", {}, {})

    got = asyncio.run(go())
    assert got.status == 429 and got.body == b'{"error": {}}' and not got.arrivals


def test_b5_cuts_the_first_chunk_into_stages_that_add_up_to_it() -> None:
    from bench import b5_stream

    sent = 1000.0
    # Made 3 ms after sending, claimed 5 ms later, first chunk produced 9 ms after the claim
    # (the engine's time to first token 6 ms of it: 12 prompt tokens at 2,000 a second),
    # read by the client 2 ms later; the second chunk 10 ms after the first.
    row = SimpleNamespace(
        created=sent + 0.003,
        started=sent + 0.008,
        events=[
            {"type": "chunk", "id": "1-1", "t": sent + 0.017},
            {"type": "chunk", "id": "1-2", "t": sent + 0.027},
            {"type": "end", "id": "1-3"},
        ],
        generation_stats={"prompt_tokens": 12, "prompt_tps": 2000.0},
    )
    result = {"job_id": "job_1", "sent": sent, "arrivals": [("1-1", sent + 0.019), ("1-2", sent + 0.030)]}
    got = b5_stream.figures([result], {"job_1": row})
    stages = {name: got[f"stage_{name}_p50_ms"] for name in b5_stream.STAGES}
    assert stages == pytest.approx({"api": 3.0, "queue": 5.0, "worker": 3.0, "engine": 6.0, "delivery": 2.0})
    assert sum(stages.values()) == pytest.approx(got["ttfc_p50_ms"])
    assert got["added_ttfc_p50_ms"] == pytest.approx(19.0 - 6.0)
    assert got["delivery_lag_p99_ms"] == pytest.approx(3.0, abs=0.01)


def test_b5_reads_each_p99_from_enough_requests_that_it_is_not_the_slowest() -> None:
    from bench import b5_stream

    for streams in (1, 16, 64):
        taken = load.rounds(streams, b5_stream.SAMPLES) * streams
        latencies = [float(i) for i in range(taken)]
        # One hiccup of the machine's in a level must not be its p99.
        assert load.pct(latencies, 99) < max(latencies), streams
