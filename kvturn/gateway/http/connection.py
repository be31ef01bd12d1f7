"""One client connection of the gateway's HTTP/1.1 server: requests read off it with
``httptools`` within the server's limits (head, body, body budget, read deadline), queued when
pipelined, served one at a time in order through the app (:mod:`.exchange` writes the
replies), and closed when idle, refused or stopping."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

import httptools
import orjson

from kvturn.gateway.errors import BodyTooLarge, GatewayError, InvalidRequest, ServerBusy
from kvturn.gateway.http.budget import BodyBudget
from kvturn.gateway.http.exchange import ASGIApp, ReplyWriter, Request, serve_asgi

logger = logging.getLogger("kvturn.gateway")

_MAX_PIPELINED = 16  # parsed requests queued per connection before reading pauses
_WRITE_HIGH_WATER = 256 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: After refusing a request whose body was still coming, how long the client may go on sending
#: it (read and dropped) before the connection closes.
_LINGER_S = 2.0


#: What a request's head says about it, before its body is read (:attr:`ServerLimits.admit`).
Admit = Callable[[str, str, list[tuple[bytes, bytes]]], GatewayError | str | None]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What the server accepts from its clients, and for how long it waits for them."""

    #: An idle keep-alive connection is closed after this long.
    keep_alive_s: float = 60.0
    #: A request head (request line and headers) larger than this gets a 431.
    max_head_bytes: int = 64 * 1024
    #: A request body larger than this gets a 413 (also when chunked).
    max_body_bytes: int = 32 * 1024 * 1024
    #: Request body bytes read and not yet served, all connections together (503 past it).
    body_budget_bytes: int = 64 * 1024 * 1024
    #: A request must arrive whole (head and body) this soon after its first byte (else 408).
    read_timeout_s: float = 60.0
    #: Open connections at once; past it, a new one gets a 503 and is closed.
    max_connections: int = 4096
    #: Request body bytes one caller (one key of :attr:`admit`'s) may hold at once (429 past
    #: it), so that no caller can take the whole budget from the others.
    caller_body_budget_bytes: int = 32 * 1024 * 1024
    #: Asked of every request's head before a byte of its body is read: (method, path,
    #: headers) → an error to refuse it with (an unknown API key: its body is never read),
    #: the caller whose share of the body budget it takes, or ``None`` (the budget alone).
    admit: Admit | None = None


class ConnectionHost(Protocol):
    """What the connections of one server share (:class:`~.server.HttpServer` is one)."""

    loop: asyncio.AbstractEventLoop
    limits: ServerLimits
    #: What serves requests: the app, with its lifespan state once that started.
    serving: ASGIApp
    #: The connection cap in force (``limits.max_connections``, or less: see the server).
    max_connections: int
    connections: set[Connection]
    #: Request body bytes read and not yet served, on every connection, and by caller.
    budget: BodyBudget
    stopping: bool


class Connection(asyncio.Protocol):
    """One client connection: reads requests, serves them in order, keeps it alive or not."""

    def __init__(self, host: ConnectionHost):
        self.host = host
        self.limits = host.limits
        self.loop = host.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.writer = ReplyWriter(self.loop)
        self.closed = False
        self.refused = False  # stop parsing: the connection ends after the queued replies
        self.linger = False  # refused while its body was still coming: close_lingering()
        self.pending: collections.deque[Request] = collections.deque()
        self.worker: asyncio.Task[None] | None = None
        self.busy = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.gone: asyncio.Future[None] = self.loop.create_future()
        self.addresses: tuple[tuple[str, int] | None, tuple[str, int] | None] = (None, None)
        self._request = Request()
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        #: The caller the body being read counts against (:attr:`ServerLimits.admit`); or its
        #: bytes so far, dropped as they come (refused from its head; ``None``: not dropped).
        self._budget_key: str | None = None
        self._dropped: int | None = None
        #: A request's head is being read (httptools buffers it until it is whole), the raw
        #: bytes it has taken so far, and whether it began in the chunk being parsed.
        self._in_head = False
        self._head_raw = 0
        self._began_in_chunk = False
        #: Fires if the request being read is not whole within the read deadline.
        self.read_timer: asyncio.TimerHandle | None = None
        #: A request read after others not yet answered expects ``100 Continue``; the client
        #: sends no more (half-closed, or past an upgrade).
        self._continue_owed = self._eof = self.replying = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = self.writer.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.addresses = (
            _address(transport.get_extra_info("peername")),
            _address(transport.get_extra_info("sockname")),
        )
        self.host.connections.add(self)
        if len(self.host.connections) > self.host.max_connections:
            # Past the cap a connection gets a 503 (the SDKs retry) and is closed: the
            # gateway's file descriptors stay available to the connections it serves.
            self._refuse(503, "the gateway has too many open connections; retry shortly")
            return
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writer.lost()
        self.host.connections.discard(self)
        self._cancel_idle_timer()
        self._cancel_read_timer()
        if not self.gone.done():
            self.gone.set_result(None)
        # Bodies that will never be served leave the budget now (the one being served, if
        # any, leaves it when its worker finishes).
        self.host.budget.give_back(self._budget_key, self._body_bytes)
        self._body_bytes = 0
        for request in self.pending:
            self.host.budget.give_back(request.budget_key, request.held)
            request.held = 0

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self._began_in_chunk = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade is ignored, as HTTP allows: its request was answered as any (or is
            # refused, if it never ended); nothing after it is HTTP, so nothing is read.
            if self.pending or self.busy:
                self.refused = self._eof = True
            else:
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
            if self._head_raw > self.limits.max_head_bytes:
                self._refuse(431, f"request head is larger than {self.limits.max_head_bytes} bytes")

    def eof_received(self) -> bool:
        """The client closed its side. While a reply it is reading is under way (a stream),
        that may be a half-close: the reply goes on, then the connection closes (a client
        that is gone fails the next write). Before any reply, it is taken as the client
        leaving: the connection closes, and with it the request's engine work."""
        self._eof = True
        return self.busy and self.replying

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._cancel_idle_timer()
        self._in_head, self._head_raw, self._began_in_chunk = True, 0, True
        self._cancel_read_timer()
        self.read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)
        self._request = Request()
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._budget_key = self._dropped = None

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
                if value.isdigit() and int(value) > self.limits.max_body_bytes:
                    self._refuse(_too_large(self.limits), linger=True)
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        verdict = admission(self.limits, request)
        if isinstance(verdict, GatewayError):
            # Refused from its head (an unknown key): not a byte of its body is held. It is
            # read and dropped, and the app, which makes the same check, answers it.
            self._dropped = 0
        else:
            self._budget_key = verdict
        if expect_continue:
            if not self.busy and not self.pending:
                self.transport.write(_CONTINUE)
            else:
                # Pipelined behind requests not yet answered: a 100 now would be taken as
                # theirs. It goes out once every reply before it has (see _work).
                self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        if self._dropped is not None:
            self._dropped += len(body)
            if self._dropped > self.limits.max_body_bytes:
                self._refuse(_too_large(self.limits), linger=True)
            return
        self._body_bytes += len(body)
        over = self.host.budget.take(self._budget_key, len(body))
        if self._body_bytes > self.limits.max_body_bytes:
            self._refuse(_too_large(self.limits), linger=True)
            return
        if over is not None:
            # Bodies being read or served are bounded, one caller's and all together: past
            # either a request is turned away (429 or 503: the SDKs retry both), not buffered.
            self._refuse(over, linger=True)
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        if self.refused:
            return
        # A body that arrived whole with its head needs no 100 Continue (one owed stays unsent).
        self._continue_owed = False
        request = self._request
        request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request.held, self._body_bytes = self._body_bytes, 0
        request.budget_key = self._budget_key
        self._queue(request)

    # -- requests in, replies out -------------------------------------------------------------

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.limits.max_head_bytes and not self.refused:
            self._refuse(431, f"request head is larger than {self.limits.max_head_bytes} bytes")

    def _refuse(self, error: GatewayError | int, message: str = "", linger: bool = False) -> None:
        """Answer ``error`` (or a ``status`` and ``message``: :func:`refusal`) after the
        replies already queued, then close: the rest of what the client sent cannot be
        trusted to start a request. ``linger``: its body is still coming (close_lingering)."""
        error = refusal(error, message) if isinstance(error, int) else error
        self.refused = True
        self.linger = linger
        self.host.budget.give_back(self._budget_key, self._body_bytes)
        self._body_bytes = 0
        self.transport.pause_reading()
        request = Request()
        request.keep_alive = False
        request.refusal = error
        self._queue(request)

    def _queue(self, request: Request) -> None:
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
                    await serve(self, request)
                except Exception:
                    logger.exception("unexpected error serving a request; closing the connection")
                    request.keep_alive = False
                finally:
                    self.busy = False
                    self.host.budget.give_back(request.budget_key, request.held)
                    request.held = 0
                if not request.keep_alive or self.host.stopping or (self._eof and not self.pending):
                    if self.linger and not self._eof and not self.host.stopping:
                        close_lingering(self.transport, self.loop)
                    else:
                        self.transport.close()
                    return
                if len(self.pending) < _MAX_PIPELINED and not self.refused:
                    self.transport.resume_reading()
                if self._continue_owed and not self.pending and not self.closed:
                    # The request that expects it is the one being read: its turn now.
                    self._continue_owed = False
                    self.transport.write(_CONTINUE)
        finally:
            self.worker = None
            if not self.transport.is_closing():
                self._arm_idle_timer()

    # -- idle connections ---------------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        if self.host.stopping:
            self.transport.close()
            return
        self.idle_timer = self.loop.call_later(self.limits.keep_alive_s, self._idle_timeout)

    def _cancel_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        """A request whose head or body started but did not finish in time (a client that
        trickles it, or stalled): 408, then closed."""
        self.read_timer = None
        if not self.refused and not self.closed:
            self._refuse(408, f"request not received within {self.limits.read_timeout_s:g} s")

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


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def close_lingering(transport: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Close a connection refused mid-body (as nginx and Apache do it): the client may still
    be sending the body, and closing with its bytes unread would reset the connection, so that
    it never reads the answer (a 413 or 429 the SDKs act on) and sees a connection error
    instead. So: close this side, drop what still comes (``data_received`` reads nothing once
    refused) for up to ``_LINGER_S``, then close; sooner if the client closes its side."""
    if not transport.can_write_eof():
        transport.close()
        return
    transport.write_eof()
    transport.resume_reading()
    loop.call_later(_LINGER_S, transport.close)


def _too_large(limits: ServerLimits) -> GatewayError:
    return refusal(413, f"request body is larger than {limits.max_body_bytes}")


def refusal(status: int, message: str) -> GatewayError:
    """The error a request refused while it was read gets (``status``: 4xx or 503)."""
    error: GatewayError = (
        BodyTooLarge(message)
        if status == 413
        else ServerBusy(message)
        if status == 503
        else InvalidRequest(message)
    )
    error.status = status
    return error


def admission(limits: ServerLimits, request: Request) -> GatewayError | str | None:
    """What :attr:`ServerLimits.admit` says of a request from its head (``None`` without it)."""
    if limits.admit is None:
        return None
    path = unquote(request.url.split(b"?", 1)[0].decode("latin-1"))
    return limits.admit(request.method, path, request.headers)


async def serve(connection: Connection, request: Request) -> None:
    """Serve one request of ``connection``: its refusal, or the app's answer."""
    connection.replying = False
    if request.refusal is not None:
        error = request.refusal
        body = orjson.dumps(error.body())
        connection.writer.write_json(request, error.status, body, error.retry_after_s)
        return
    app, writer, gone = connection.host.serving, connection.writer, connection.gone
    if request.method != "POST":
        await serve_asgi(app, request, writer, gone, connection.addresses)
        return
    # The client may leave before the reply starts (a non-streamed turn waits for the whole
    # reply): then this worker, and with it the request's engine work, is cancelled, not left
    # to run. (A callback on the connection's end, not a task per request raced against it:
    # 1 us instead of 22.) ASGI servers leave that to the app. Once the reply has started, the
    # app learns of a client that left from ``receive`` and ends the reply its own way (a
    # streamed turn's client may close as soon as it has read ``[DONE]``).
    worker = asyncio.current_task()
    assert worker is not None

    def client_left(_: object) -> None:
        worker.cancel()

    def reply_started() -> None:
        connection.replying = True
        gone.remove_done_callback(client_left)

    gone.add_done_callback(client_left)
    try:
        await serve_asgi(app, request, writer, gone, connection.addresses, reply_started)
    finally:
        gone.remove_done_callback(client_left)
