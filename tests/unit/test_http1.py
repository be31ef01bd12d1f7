"""The gateway's HTTP/1.1 client against scripted raw servers: framing, keep-alive, stale
connections, streams, timeouts and failures."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from kvturn.gateway.http.client import HttpClient, HttpError


class Server:
    """Reads each request head (+ Content-Length body) and lets ``answer`` write the reply."""

    def __init__(self, answer: Callable[[bytes, bytes, asyncio.StreamWriter], object]):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                result = self.answer(head, body, writer)
                if asyncio.iscoroutine(result):
                    await result
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def serving(server: Server) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        for writer in server.writers:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(*pieces: bytes) -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"


async def test_request_sends_body_and_headers_and_reuses_the_connection() -> None:
    server = Server(lambda head, body, w: w.write(ok(b'{"echo": %d}' % len(body))))
    client = HttpClient()
    async with serving(server) as url:
        for n in range(3):
            response = await client.request(
                "POST", f"{url}/v1/x?q=1", b"a" * n, {"X-Request-Id": f"r{n}"}
            )
            assert response.status == 200
            assert response.json() == {"echo": n}
            assert response.headers["content-length"] == str(len(response.body))
    await client.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
    assert b"\r\nx-request-id: r0\r\n" in first.lower()
    assert first.endswith(b"\r\n\r\n")  # empty body
    assert server.requests[2].endswith(b"\r\n\r\naa")


async def test_parallel_requests_use_separate_connections() -> None:
    async def slow(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.05)
        writer.write(ok(body))

    server = Server(slow)
    client = HttpClient()
    async with serving(server) as url:
        answers = await asyncio.gather(
            *(client.request("POST", url + "/", b"%d" % i) for i in range(5))
        )
    await client.close()
    assert [a.body for a in answers] == [b"%d" % i for i in range(5)]
    assert server.connections == 5


async def test_chunked_response_is_streamed_and_read_whole() -> None:
    server = Server(lambda head, body, w: w.write(chunked(b"data: a\n\n", b"data: b\n\n")))
    client = HttpClient()
    async with serving(server) as url:
        whole = await client.request("GET", url + "/")
        assert whole.body == b"data: a\n\ndata: b\n\n"
        async with await client.open("GET", url + "/") as stream:
            assert stream.status == 200
            assert await stream.read() == b"data: a\n\ndata: b\n\n"
            assert stream.at_end
    await client.close()
    assert server.connections == 1  # both exchanges on one keep-alive connection


async def test_stream_chunks_arrive_as_they_are_sent() -> None:
    release = asyncio.Event()

    async def trickle(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    server = Server(trickle)
    client = HttpClient()
    async with serving(server) as url:
        stream = await client.open("POST", url + "/", b"{}")
        assert await stream.next_chunk() == b"first"
        assert not stream.at_end
        release.set()
        assert await stream.next_chunk() == b"second"
        assert stream.at_end
        assert await stream.next_chunk() is None
        await stream.aclose()
    await client.close()


async def test_closing_a_stream_early_aborts_its_connection() -> None:
    never = asyncio.Event()

    async def hang(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await never.wait()

    server = Server(hang)
    client = HttpClient()
    async with serving(server) as url:
        stream = await client.open("POST", url + "/", b"{}")
        assert await stream.next_chunk() == b"a"
        await stream.aclose()
        # The next exchange cannot use the half-read connection: it opens a new one.
        server.answer = lambda head, body, w: w.write(ok(b"fresh"))
        assert (await client.request("GET", url + "/")).body == b"fresh"
    await client.close()
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_an_error() -> None:
    def answer_then_close(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"x"))  # keep-alive response, then the server drops the connection
        writer.close()

    server = Server(answer_then_close)
    client = HttpClient()
    async with serving(server) as url:
        for _ in range(3):
            assert (await client.request("POST", url + "/", b"{}")).body == b"x"
            await asyncio.sleep(0.02)
    await client.close()
    assert server.connections == 3


def _first_request_only() -> Server:
    """A server that answers the first request of each connection and drops the connection
    at the second, which it has received."""
    served: dict[int, int] = {}

    def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        key = id(writer)
        served[key] = served.get(key, 0) + 1
        if served[key] == 1:
            writer.write(ok(b"x"))
        else:
            writer.transport.abort()

    return Server(answer)


async def test_an_idempotent_request_dropped_on_a_reused_connection_is_sent_again() -> None:
    # The race behind keep-alive timeouts: the server drops an idle connection just as the
    # next request goes out on it, and no response byte comes back. A GET is sent again on a
    # fresh connection and the caller never knows.
    server = _first_request_only()
    client = HttpClient()
    async with serving(server) as url:
        for _ in range(3):
            assert (await client.request("GET", url + "/")).body == b"x"
    await client.close()
    assert server.connections == 3
    assert len(server.requests) == 5  # 3 answered + 2 dropped on reused connections


async def test_a_post_that_went_out_is_never_sent_twice() -> None:
    # The same drop, but the server had the request (a real engine may have started a prefill
    # or a decode on it): a POST is not resent; its caller gets the error and decides.
    server = _first_request_only()
    client = HttpClient()
    async with serving(server) as url:
        assert (await client.request("POST", url + "/", b"{}")).body == b"x"
        with pytest.raises(HttpError, match="before the response was complete"):
            await client.request("POST", url + "/", b"{}")
        assert len(server.requests) == 2  # the failed POST arrived once, and only once
        assert (await client.request("POST", url + "/", b"{}")).body == b"x"  # a fresh one
    await client.close()


async def test_a_fresh_connection_dropped_before_answering_is_an_error() -> None:
    client = HttpClient()
    async with serving(Server(lambda head, body, w: w.transport.abort())) as url:
        with pytest.raises(HttpError, match="before the response was complete"):
            await client.request("POST", url + "/", b"{}")
    await client.close()


async def test_connection_refused_is_an_http_error() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    client = HttpClient(connect_timeout_s=1)
    with pytest.raises(HttpError, match="cannot connect"):
        await client.request("GET", f"http://127.0.0.1:{port}/health")
    await client.close()


async def test_server_closing_mid_body_is_an_http_error() -> None:
    def cut(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        writer.close()

    client = HttpClient()
    async with serving(Server(cut)) as url:
        with pytest.raises(HttpError, match="before the response was complete"):
            await client.request("GET", url + "/")
    await client.close()


async def test_timeout_covers_the_whole_exchange() -> None:
    async def silent(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    client = HttpClient()
    async with serving(Server(silent)) as url:
        started = asyncio.get_running_loop().time()
        with pytest.raises(HttpError, match=r"no complete response within 0\.2 s"):
            await client.request("GET", url + "/", timeout_s=0.2)
        assert asyncio.get_running_loop().time() - started < 2
    await client.close()


def _steady(pieces: int, gap_s: float, then_silent_s: float = 0.0) -> Server:
    """A chunked stream of ``pieces`` chunks ``gap_s`` apart, then (optionally) a silence
    before its end."""

    async def stream(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(pieces):
            await asyncio.sleep(gap_s)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        await asyncio.sleep(then_silent_s)
        writer.write(b"0\r\n\r\n")

    return Server(stream)


async def test_a_stream_that_keeps_sending_outlives_the_timeout() -> None:
    # 1.2 s of chunks 0.1 s apart, against a 0.4 s timeout: the timeout bounds each silence,
    # not the stream (a long reply streams for as long as the engine keeps sending).
    client = HttpClient()
    async with serving(_steady(12, 0.1)) as url:
        started = asyncio.get_running_loop().time()
        stream = await client.open("POST", url + "/", b"{}", timeout_s=0.4)
        assert await stream.read() == b"x" * 12
        assert asyncio.get_running_loop().time() - started > 1.0
    await client.close()


async def test_a_stream_that_falls_silent_is_cut_after_the_timeout() -> None:
    client = HttpClient()
    async with serving(_steady(3, 0.05, then_silent_s=5)) as url:
        stream = await client.open("POST", url + "/", b"{}", timeout_s=0.3)
        started = asyncio.get_running_loop().time()
        with pytest.raises(HttpError, match=r"no bytes of the response for 0\.3 s"):
            await stream.read()
        assert asyncio.get_running_loop().time() - started < 2
    await client.close()


async def test_a_stream_whose_first_bytes_never_come_is_cut_after_the_timeout() -> None:
    # Headers at once (as vLLM sends them), the first token never.
    client = HttpClient()
    async with serving(_steady(0, 0, then_silent_s=5)) as url:
        stream = await client.open("POST", url + "/", b"{}", timeout_s=0.3)
        with pytest.raises(HttpError, match=r"no bytes of the response for 0\.3 s"):
            await stream.read()
    await client.close()


async def test_a_whole_stream_cap_cuts_a_stream_that_keeps_sending() -> None:
    client = HttpClient(max_stream_s=0.5)
    async with serving(_steady(40, 0.05)) as url:
        stream = await client.open("POST", url + "/", b"{}", timeout_s=0.3)
        started = asyncio.get_running_loop().time()
        with pytest.raises(HttpError, match=r"ran past its cap of 0\.5 s"):
            await stream.read()
        assert asyncio.get_running_loop().time() - started < 1.5
    await client.close()


async def test_malformed_response_is_an_http_error() -> None:
    client = HttpClient()
    async with serving(Server(lambda head, body, w: w.write(b"NOT HTTP AT ALL\r\n\r\n"))) as url:
        with pytest.raises(HttpError, match="malformed"):
            await client.request("GET", url + "/")
    await client.close()


async def test_header_values_with_line_breaks_are_refused() -> None:
    client = HttpClient()
    with pytest.raises(ValueError, match="line break"):
        await client.request("GET", "http://127.0.0.1:9/", None, {"X-Evil": "a\r\nInjected: 1"})
    await client.close()


async def test_a_slow_stream_reader_pauses_reading() -> None:
    big = b"x" * (256 * 1024)

    async def flood(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(40):  # 10 MiB
            writer.write(b"%x\r\n%s\r\n" % (len(big), big))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    client = HttpClient()
    async with serving(Server(flood)) as url:
        stream = await client.open("GET", url + "/")
        await asyncio.sleep(0.3)  # the server writes as fast as it can; nobody reads
        conn = stream._conn
        assert conn is not None and conn.paused
        assert conn.buffered < 4 * 1024 * 1024
        total = len(await stream.read())
        assert total == 40 * len(big)
    await client.close()


async def test_running_out_of_descriptors_is_the_gateways_fault_not_the_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue #39, case 2: a gateway out of file descriptors marked a healthy prefill engine
    unhealthy, and its log blamed the engine. A connect that fails for want of this process's
    own resources is reported as such, and says nothing of the engine's health."""
    import asyncio
    import errno

    from kvturn.gateway.http.upstream import Upstream, UpstreamUnavailable

    loop = asyncio.get_running_loop()

    async def no_descriptors(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    upstream = Upstream(connect_timeout_s=1, request_timeout_s=1)
    await upstream.start()
    try:
        monkeypatch.setattr(loop, "create_connection", no_descriptors)
        with pytest.raises(UpstreamUnavailable) as failed:
            await upstream.post_json("http://127.0.0.1:9/v1/completions", {})
        assert failed.value.local
        assert await upstream.is_healthy("http://127.0.0.1:9") is None  # not known
        monkeypatch.undo()
        # A port nobody listens on: refused, the engine's side.
        with pytest.raises(UpstreamUnavailable) as refused:
            await upstream.post_json("http://127.0.0.1:9/v1/completions", {})
        assert not refused.value.local
        assert await upstream.is_healthy("http://127.0.0.1:9") is False
    finally:
        await upstream.close()


# The engine on the other side of a silent network: it answers ``/slow`` only after a minute.
_SILENT_SERVER = """
import http.server, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/slow":
            time.sleep(60)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((sys.argv[1], 8000), Handler).serve_forever()
"""


@pytest.fixture
def unpluggable_host() -> Iterator[tuple[str, Callable[[], None]]]:
    """An HTTP server on a "host" of its own (a network namespace behind a veth pair), and a
    way to unplug it: its link goes down and its packets vanish, as a dead switch port or a
    host that lost power does to them (no reset, no refusal; nothing at all)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("needs root and iproute2 (ip), as the several-hosts test does")
    tag = f"kvh{os.getpid() % 100000}"
    namespace, outside, inside = f"{tag}-ns", f"{tag}a", f"{tag}b"
    net = f"10.234.{os.getpid() % 250}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", namespace)
    server: subprocess.Popen[bytes] | None = None
    try:
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", namespace)
        ip("addr", "add", f"{net}.1/30", "dev", outside)
        ip("link", "set", outside, "up")
        ip("-n", namespace, "addr", "add", f"{net}.2/30", "dev", inside)
        ip("-n", namespace, "link", "set", inside, "up")
        command = [sys.executable, "-c", _SILENT_SERVER, f"{net}.2"]
        server = subprocess.Popen(["ip", "netns", "exec", namespace, *command])
        url = f"http://{net}.2:8000"
        for _ in range(100):
            try:
                if httpx.post(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("the server in the namespace never answered")
        yield url, lambda: ip("-n", namespace, "link", "set", inside, "down")
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        ip("netns", "del", namespace)


async def test_an_unplugged_hosts_connection_fails_within_the_connect_timeout(
    unpluggable_host: tuple[str, Callable[[], None]],
) -> None:
    """The CI failure of stop 54: a decode host was unplugged, and a turn's POST to it went out
    on a pooled keep-alive connection. Nothing refused it or reset it; the gateway waited for
    the request timeout (600 s) while the client gave up at 300. A host that acknowledges
    nothing for ``connect_timeout_s``, whether bytes were just sent or the request waits on its
    answer, now ends the connection then: an :class:`HttpError`, which the turn falls back from."""
    url, unplug = unpluggable_host
    client = HttpClient(connect_timeout_s=1, timeout_s=30)
    try:
        # Two keep-alive connections, pooled: each request below goes out on one of them.
        pooled = [client.request("POST", f"{url}/x", b"{}") for _ in range(2)]
        assert [r.status for r in await asyncio.gather(*pooled)] == [200, 200]
        waiting = asyncio.create_task(client.open("POST", f"{url}/slow", b"{}"))
        await asyncio.sleep(0.5)  # its request went out and was acknowledged; it awaits headers
        unplug()
        started = time.monotonic()
        with pytest.raises(HttpError, match="before the response"):  # sent, never acknowledged
            await client.request("POST", f"{url}/x", b"{}")
        with pytest.raises(HttpError, match="before the response"):  # its answer never coming
            await waiting
        assert time.monotonic() - started < 10
    finally:
        await client.close()
