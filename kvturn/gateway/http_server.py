"""The gateway's HTTP/1.1 server. Every request, turns included, goes through the gateway's
ASGI app (:func:`~kvturn.gateway.app.create_app`), so the app's lifespan and middleware apply
to all of them; the turn endpoints are raw ASGI endpoints inside it (see :mod:`.replies`).

Why its own server and not uvicorn or granian: measured on 2026-12-02
(``benchmarks/gateway_overhead.py --servers``, one run, the same app served whole by
maintained servers): uvicorn with httptools added 0.08 ms more at concurrency 1 (0.10 ms
streamed) and served 13% fewer requests/s at concurrency 32 (15% streamed); granian 2.8.7
added 0.21 ms more (0.40 ms) at 11% (25%) fewer; uvicorn with h11 0.22 ms (0.43 ms) more at
39% (47%) fewer. uvicorn with httptools sits at the edge of "within 0.1 ms and 20%", inside
this machine's run-to-run noise (about ±0.2 ms that day; see
benchmarks/results/gateway_overhead.md). Turns then skipped the ASGI app on this server;
since they go through it, this server serves about 10% fewer turns/s at concurrency 32 than
it did (3,556 vs 3,925, 6 alternating rounds of one run; most of it Starlette's middleware
stack, 3,763 without it), and the speed difference is gone: rerun the same afternoon on a
machine then about twice as slow, this server added 0.97 ms at concurrency 1 and served 2,087
requests/s at 32, uvicorn with httptools 1.05 ms and 2,321 (streamed: 0.85 vs 0.99 ms, 2,004
vs 2,079). What decides is robustness.

It is kept because of what the same servers do under the attack cases this module answers
(``benchmarks/http_robustness.py``, 2026-12-02, each with its closest settings to this
server's read deadline and connection cap; benchmarks/results/http_robustness.md): uvicorn with
httptools left a trickled head and a trickled body open past 20 s, buffered a 64 MB header line
whole and answered it 200 (+128 MB peak memory, 5.4 s of CPU, ``/health`` at 1.9 s for
everyone meanwhile), closed new connections unanswered past 1,100 idle ones (no 503), and let
a chunked trailer become the conversation id; uvicorn with h11 and granian each left at least
the trickled body open, and no ASGI server cancels a non-streamed turn's engine request when its
client leaves (this server cancels a POST's handler then). Here every case is bounded: 408 at
the read deadline, 431 after 3.2 MB, a 503 past the cap, the engine request cancelled within
0.5 s, trailers ignored.

What it does as an HTTP server: keep-alive with an idle timeout, pipelined requests
answered in order, ``Expect: 100-continue``, HTTP/1.0 clients (no chunked replies, closed
after), limits on the request head (431) and body (413, also when chunked), malformed
requests answered 400 and closed, back-pressure on slow stream readers, a stream stopped (and
its engine request closed) as soon as its reader disconnects, and a graceful stop that lets
in-flight requests finish. Every error body is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import resource
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools
import orjson
from asgi_lifespan import LifespanManager
from starlette.applications import Starlette

from kvturn.gateway.errors import (
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    ServerBusy,
    error_body,
)
from kvturn.gateway.replies import Reply, error_reply

logger = logging.getLogger("kvturn.gateway")

_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 304: "Not Modified",
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
    413: "Content Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Content",
    429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Gateway Timeout",
}  # fmt: skip
_STATUS_LINES = {
    code: f"HTTP/1.1 {code} {reason}\r\n".encode() for code, reason in _REASONS.items()
}
_NO_BODY_STATUSES = frozenset({204, 304})
_MAX_PIPELINED = 16  # parsed requests queued per connection before reading pauses
_WRITE_HIGH_WATER = 256 * 1024


def header_lines(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Response header lines, as ASGI gives them; a name or value that would break the head
    (CR, LF, NUL; a name that is not a token) is dropped and logged, never written."""
    lines = []
    for name, value in headers:
        if _UNSAFE_VALUE.search(value) or not _TOKEN.fullmatch(name):
            logger.error("response header %r dropped: its name or value is not safe to send", name)
            continue
        lines.append(b"%s: %s\r\n" % (name, value))
    return lines


_UNSAFE_VALUE = re.compile(rb"[\r\n\x00]")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


#: File descriptors kept for the gateway's own connections (engines, Redis, logs).
_FD_RESERVE = 256


def _connection_cap(configured: int) -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - _FD_RESERVE >= configured:
        return configured
    cap = max(16, soft - _FD_RESERVE)
    logger.warning(
        "max_connections %d lowered to %d: this process may open %d files (ulimit -n)",
        configured,
        cap,
        soft,
    )
    return cap


def _status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Status\r\n".encode()


class _Date:
    """The ``date`` header value, formatted once per second."""

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


_date = _Date()


class _Request:
    __slots__ = ("body", "headers", "held", "keep_alive", "method", "refusal", "url", "version")

    def __init__(self) -> None:
        self.method = ""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.keep_alive = True
        self.version = "1.1"
        #: (status, message) when the request was refused while it was being read
        self.refusal: tuple[int, str] | None = None
        #: Body bytes counted against the server's budget until the request is served.
        self.held = 0


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer):
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.closed = False
        self.refused = False  # stop parsing: the connection ends after the queued replies
        self.pending: collections.deque[_Request] = collections.deque()
        self.worker: asyncio.Task[None] | None = None
        self.busy = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.gone: asyncio.Future[None] = self.loop.create_future()
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self._request = _Request()
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        #: A request's head is being read (httptools buffers it until it is whole), the raw
        #: bytes it has taken so far, and whether it began in the chunk being parsed.
        self._in_head = False
        self._head_raw = 0
        self._began_in_chunk = False
        #: Fires if the request being read is not whole within the read deadline.
        self.read_timer: asyncio.TimerHandle | None = None
        #: A request read after others not yet answered expects ``100 Continue``.
        self._continue_owed = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        self.server.connections.add(self)
        if len(self.server.connections) > self.server.max_connections:
            # Past the cap a connection gets a 503 (the SDKs retry) and is closed: the
            # gateway's file descriptors stay available to the connections it serves.
            self._refuse(503, "the gateway has too many open connections; retry shortly")
            return
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._cancel_idle_timer()
        self._cancel_read_timer()
        if not self.gone.done():
            self.gone.set_result(None)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        # Bodies that will never be served leave the budget now (the one being served, if
        # any, leaves it when its worker finishes).
        self._release(self._body_bytes)
        self._body_bytes = 0
        for request in self.pending:
            self._release(request.held)
            request.held = 0

    def _release(self, size: int) -> None:
        self.server.body_bytes_held -= size

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self._began_in_chunk = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as error:
            self._refuse(400, f"malformed HTTP request: {error}")
        if self._in_head and not self.refused:
            # Bound what httptools buffers of an unfinished head (one endless header line
            # reaches on_header only once it ends): every byte of a chunk after which the head
            # is still unfinished is head, but for a chunk the head began in (not counted:
            # it may end another request) - so the bound is the limit plus one chunk.
            if not self._began_in_chunk:
                self._head_raw += len(data)
            if self._head_raw > self.server.max_head_bytes:
                self._refuse(431, f"request head is larger than {self.server.max_head_bytes} bytes")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._cancel_idle_timer()
        self._in_head, self._head_raw, self._began_in_chunk = True, 0, True
        self._cancel_read_timer()
        self.read_timer = self.loop.call_later(self.server.read_timeout_s, self._read_timed_out)
        self._request = _Request()
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._request.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer: never lets a sender change the request's headers
        self._request.headers.append((name.lower(), value))
        self._count_head(len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self.refused:
            return
        request = self._request
        request.method = self.parser.get_method().decode("latin-1")
        request.version = self.parser.get_http_version()
        request.keep_alive = self.parser.should_keep_alive()
        expect_continue = False
        for name, value in request.headers:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.server.max_body_bytes:
                    self._refuse(413, f"request body is larger than {self.server.max_body_bytes}")
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        if expect_continue:
            if not self.busy and not self.pending:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                # Pipelined behind requests not yet answered: a 100 now would be taken as
                # theirs. It goes out once every reply before it has (see _work).
                self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        self._body_bytes += len(body)
        self.server.body_bytes_held += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            self._refuse(413, f"request body is larger than {self.server.max_body_bytes}")
            return
        if self.server.body_bytes_held > self.server.body_budget_bytes:
            # Bodies being read or served, all connections together, are bounded: past the
            # budget a request is turned away (503: the SDKs retry it), not buffered.
            self._refuse(503, "the gateway is holding too many request bodies; retry shortly")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        if self.refused:
            return
        request = self._request
        request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request.held, self._body_bytes = self._body_bytes, 0
        self._queue(request)

    # -- requests in, replies out -------------------------------------------------------------

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.server.max_head_bytes and not self.refused:
            self._refuse(431, f"request head is larger than {self.server.max_head_bytes} bytes")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` after the replies already queued, then close: the rest of
        what the client sent cannot be trusted to start a request."""
        self.refused = True
        self._release(self._body_bytes)
        self._body_bytes = 0
        self.transport.pause_reading()
        request = _Request()
        request.keep_alive = False
        request.refusal = (status, message)
        self._queue(request)

    def _queue(self, request: _Request) -> None:
        self.pending.append(request)
        if len(self.pending) >= _MAX_PIPELINED and not self.refused:
            self.transport.pause_reading()
        if self.worker is None:
            self.worker = self.loop.create_task(self._work())

    async def _work(self) -> None:
        try:
            while self.pending and not self.closed:
                request = self.pending.popleft()
                self.busy = True
                try:
                    await self._serve(request)
                except Exception:
                    logger.exception("unexpected error serving a request; closing the connection")
                    request.keep_alive = False
                finally:
                    self.busy = False
                    self._release(request.held)
                    request.held = 0
                if not request.keep_alive or self.server.stopping:
                    self.transport.close()
                    return
                if len(self.pending) < _MAX_PIPELINED and not self.refused:
                    self.transport.resume_reading()
                if self._continue_owed and not self.pending and not self.closed:
                    # The request that expects it is the one being read: its turn now.
                    self._continue_owed = False
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        finally:
            self.worker = None
            if not self.transport.is_closing():
                self._arm_idle_timer()

    async def _serve(self, request: _Request) -> None:
        if request.refusal is not None:
            status, message = request.refusal
            error: GatewayError = (
                BodyTooLarge(message)
                if status == 413
                else ServerBusy(message)
                if status == 503
                else InvalidRequest(message)
            )
            error.status = status
            self._write_reply(request, error_reply(error))
            return
        if request.method != "POST":
            await self._asgi(request)
            return
        # The client may leave before the reply starts (a non-streamed turn waits for the
        # whole reply): then this worker, and with it the request's engine work, is cancelled,
        # not left to run. (A callback on the connection's end, not a task per request raced
        # against it: 1 us instead of 22.) ASGI servers leave that to the app. Once the reply
        # has started, the app learns of a client that left from ``receive`` and ends the reply
        # its own way (a streamed turn's client may close as soon as it has read ``[DONE]``).
        worker = asyncio.current_task()
        assert worker is not None

        def client_left(_: object) -> None:
            worker.cancel()

        def reply_started() -> None:
            self.gone.remove_done_callback(client_left)

        self.gone.add_done_callback(client_left)
        try:
            await self._asgi(request, reply_started)
        finally:
            self.gone.remove_done_callback(client_left)

    def _write_reply(self, request: _Request, reply: Reply) -> None:
        """A reply the server makes itself (a refused request, an error the app did not
        answer)."""
        if self.closed:
            return
        head = [_status_line(reply.status), b"date: ", _date(), b"\r\n"]
        if not request.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(reply.body)
        )
        head.append(reply.body)
        self.transport.write(b"".join(head))

    async def _drain(self) -> None:
        while self.write_paused and not self.closed:
            self.drained = self.loop.create_future()
            await self.drained
        self.drained = None

    async def _asgi(
        self, request: _Request, reply_started: Callable[[], None] | None = None
    ) -> None:
        """A request, through the ASGI app; ``reply_started()`` is called as its reply starts."""
        raw_path, _, query = request.url.partition(b"?")
        scope = {
            "type": "http",
            "asgi": _ASGI_VERSION,
            "http_version": request.version,
            "method": request.method,
            "scheme": "http",
            "path": unquote(path) if "%" in (path := raw_path.decode("latin-1")) else path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": self.client,
            "server": self.local,
        }
        body_read = False
        started: dict[str, Any] = {}
        chunked: bool | None = None  # decided at the first body message

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # Nothing more will come: wait until the client leaves. Shielded: an app that calls
            # off its wait (a relay that ended) cancels this call, never the connection's own
            # future, which later requests on the connection still need.
            await asyncio.shield(self.gone)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal chunked
            if self.closed:
                return
            if message["type"] == "http.response.start":
                started["status"] = message["status"]
                started["headers"] = list(message.get("headers", []))
                if reply_started is not None:
                    reply_started()
                return
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if request.method == "HEAD":
                body = b""
            if chunked is None:
                head = [_status_line(started["status"]), b"date: ", _date(), b"\r\n"]
                has_length = False
                for name, _ in started["headers"]:
                    has_length = has_length or name.lower() == b"content-length"
                head += header_lines(started["headers"])
                if not request.keep_alive:
                    head.append(b"connection: close\r\n")
                chunked = more and not has_length and request.version != "1.0"
                if started["status"] in _NO_BODY_STATUSES:
                    chunked = False
                elif chunked:
                    head.append(b"transfer-encoding: chunked\r\n")
                elif not has_length:
                    if more:
                        request.keep_alive = False  # HTTP/1.0 stream: delimited by closing
                        head.append(b"connection: close\r\n")
                    elif request.method != "HEAD":
                        head.append(b"content-length: %d\r\n" % len(body))
                head.append(b"\r\n")
                self.transport.write(b"".join(head) + (_frame(body, more) if chunked else body))
            elif chunked:
                self.transport.write(_frame(body, more))
            else:
                self.transport.write(body)
            if self.write_paused:
                await self._drain()

        try:
            await self.server.serving(scope, receive, send)
        except Exception:
            logger.exception("unexpected error serving %s %s", request.method, scope["path"])
            if chunked is None and not self.closed:
                error = orjson.dumps(error_body("internal gateway error", "server_error"))
                self._write_reply(request, Reply(500, error))
            else:
                request.keep_alive = False
        else:
            if chunked is None and not self.closed:  # the app sent no body at all
                request.keep_alive = False

    # -- idle connections ---------------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        if self.server.stopping:
            self.transport.close()
            return
        self.idle_timer = self.loop.call_later(self.server.keep_alive_s, self._idle_timeout)

    def _cancel_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        """A request whose head or body started but did not finish in time (a client that
        trickles it, or stalled): 408, then closed."""
        self.read_timer = None
        if not self.refused and not self.closed:
            self._refuse(408, f"request not received within {self.server.read_timeout_s:g} s")

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle_timeout(self) -> None:
        self.idle_timer = None
        if not self.busy and not self.pending:
            self.transport.close()

    def close_if_idle(self) -> None:
        if not self.busy and not self.pending:
            self.transport.close()


_ASGI_VERSION = {"version": "3.0", "spec_version": "2.3"}


def _frame(body: bytes, more: bool) -> bytes:
    framed = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
    return framed if more else framed + b"0\r\n\r\n"


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


class HttpServer:
    """Serves the gateway's ASGI app (:func:`~kvturn.gateway.app.create_app`) on
    ``host:port``, its lifespan included."""

    def __init__(
        self,
        app: Starlette,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        keep_alive_s: float = 60.0,
        max_head_bytes: int = 64 * 1024,
        reuse_port: bool = False,
    ):
        self.app = app
        gateway = app.state.gateway
        #: What serves requests once the lifespan started: the app with its lifespan state.
        self.serving: Any = app
        self._lifespan = contextlib.AsyncExitStack()
        #: Listen with ``SO_REUSEPORT``: several worker processes share the port.
        self.reuse_port = reuse_port
        self.host = host
        self.port = port
        self.keep_alive_s = keep_alive_s
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = gateway.config.max_body_bytes
        self.body_budget_bytes = gateway.config.body_budget_bytes
        #: A request must arrive whole (head and body) this soon after its first byte.
        self.read_timeout_s = gateway.config.read_timeout_s
        #: Open connections at once; past it, a new one gets a 503 and is closed. Never more
        #: than the process's file descriptors allow, less what the gateway needs for its own
        #: engine and state connections: past that, every new connection would fail.
        self.max_connections = _connection_cap(gateway.config.max_connections)
        #: Request body bytes read and not yet served, on every connection.
        self.body_bytes_held = 0
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start()

    async def start(self) -> None:
        """Run the app's lifespan start-up (the gateway's engine client, health checks),
        then listen."""
        self.loop = asyncio.get_running_loop()
        # No time limit: start-up waits for the engines' answers, each bounded on its own.
        lifespan = LifespanManager(self.app, startup_timeout=None, shutdown_timeout=None)
        self.serving = (await self._lifespan.enter_async_context(lifespan)).app
        try:
            self._server = await self.loop.create_server(
                lambda: _Connection(self),
                self.host,
                self.port,
                backlog=2048,
                reuse_port=self.reuse_port or None,
            )
        except OSError:
            await self._lifespan.aclose()
            raise
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop listening, let in-flight requests finish (up to ``grace_s``), then stop."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = self.loop.time() + grace_s
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)
        await self._lifespan.aclose()


__all__ = ["HttpServer"]
