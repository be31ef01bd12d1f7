"""The engine client's connections (:mod:`.client`): one keep-alive connection per exchange,
an :class:`asyncio.Protocol` fed to ``httptools`` that wakes its caller once per response (or
per arriving chunk when streaming) and keeps the exchange's deadline; and the pool of them per
origin. The semantics (stale connections, timeouts, streams) are the client's docstring's."""

from __future__ import annotations

import asyncio
import collections
import errno
import math
import socket
import time
from typing import Any, Protocol

import httptools

STREAM_HIGH_WATER = 1 << 20  # bytes buffered for a stream reader before reading pauses


class PoolSettings(Protocol):
    """What a pool reads of its client (:class:`~.client.HttpClient`)."""

    connect_timeout_s: float
    idle_timeout_s: float
    max_idle_per_origin: int


class HttpError(Exception):
    """The exchange failed: no (complete) response."""


class LocalResourceError(HttpError):
    """This process could not open a connection for want of its own resources (file
    descriptors, buffers, memory): no fault of the server it was for."""


#: ``errno`` values of a failed connect that are this process's own want (EMFILE, ENFILE,
#: ENOBUFS, ENOMEM, EADDRNOTAVAIL: out of descriptors, buffers, memory or local ports).
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                          errno.EADDRNOTAVAIL})  # fmt: skip


class Stale(HttpError):
    """A reused connection failed before any response byte: the server closed it while idle
    (and never saw the request), or, rarely, failed while serving it."""

    def __init__(self, message: str, *, before_sending: bool = False):
        super().__init__(message)
        #: Found closed before the request was written: it certainly never arrived.
        self.before_sending = before_sending


def notice_silence(sock: Any, after_s: float) -> None:
    """End the connection once its host acknowledges nothing for ``after_s``: bytes sent and
    never acknowledged (``TCP_USER_TIMEOUT``), or, while a request awaits its answer, keepalive
    probes never answered. An engine host that was unplugged, lost power or was cut off by the
    network refuses and resets nothing: without this a request to it waits out its whole
    timeout (minutes), where its turn could have fallen back at once. A live host's kernel
    acknowledges at once, however busy its engine. Linux's options; elsewhere, keepalive
    with the system's timings."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(after_s * 1000))
    if hasattr(socket, "TCP_KEEPIDLE") and hasattr(socket, "TCP_KEEPINTVL"):
        idle_s = max(1, math.ceil(after_s / 2))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)


#: Methods that may be sent again after a stale connection (RFC 9110 §9.2.2).
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one exchange at a time."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.got_bytes = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = True
        self.error: HttpError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.deadline: asyncio.TimerHandle | None = None
        self.timeout_s = 0.0
        #: A stream: ``timeout_s`` bounds each silence (from the request to its first body
        #: bytes, then between arrivals), ``max_s`` (0: none) the whole exchange.
        self.streaming = False
        self.max_s = 0.0
        self.started_at = 0.0
        self.last_arrival = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(HttpError(f"malformed response: {error}"))
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if (
            self.headers_done
            and "content-length" not in self.headers
            and ("transfer-encoding" not in self.headers)
        ):
            self.on_message_complete()  # a body delimited by the connection closing
            return
        stale = self.reused and not self.got_bytes
        error = (Stale if stale else HttpError)(
            f"connection closed before the response was complete ({exc or 'EOF'})"
        )
        self._fail(error)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.streaming:
            self.last_arrival = self.pool.loop.time()  # read when the deadline comes due
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > STREAM_HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self._wake()

    # -- the exchange -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HttpError) -> None:
        if self.error is None:
            self.error = error
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self._wake()

    def _timed_out(self) -> None:
        self.deadline = None
        if self.streaming:
            # One timer per exchange, not one per arrival: when it comes due, it is moved to
            # the end of the current silence if bytes came meanwhile.
            loop = self.pool.loop
            if self.paused:
                # The reader is behind, not the server: its silence is not the server's.
                self.last_arrival = loop.time()
            due = self.last_arrival + self.timeout_s
            if self.max_s:
                due = min(due, self.started_at + self.max_s)
            if loop.time() < due:
                self.deadline = loop.call_at(due, self._timed_out)
                return
            if self.max_s and loop.time() >= self.started_at + self.max_s:
                message = f"the stream ran past its cap of {self.max_s:g} s"
            else:
                message = f"no bytes of the response for {self.timeout_s:g} s"
        else:
            message = f"no complete response within {self.timeout_s:g} s"
        self._fail(HttpError(message))
        self.transport.abort()

    def start(
        self,
        request: bytes,
        timeout_s: float,
        loop: asyncio.AbstractEventLoop,
        *,
        streaming: bool = False,
        max_s: float = 0.0,
    ) -> None:
        self._reset()
        self.timeout_s = timeout_s
        self.streaming, self.max_s = streaming, max_s
        self.started_at = self.last_arrival = loop.time()
        first = min(timeout_s, max_s) if streaming and max_s else timeout_s
        self.deadline = loop.call_later(first, self._timed_out)
        self.transport.write(request)

    async def wait(self) -> None:
        """Until something changes (headers, a chunk, the end, an error)."""
        if self.error is not None:
            raise self.error
        self.waiter = self.pool.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    def take_chunks(self) -> list[bytes]:
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return chunks

    def abort(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Keep-alive connections to one origin (most recently used first)."""

    def __init__(self, client: PoolSettings, host: str, port: int):
        self.client = client
        self.host = host
        self.port = port
        self.loop = asyncio.get_running_loop()
        self.idle: collections.deque[Connection] = collections.deque()
        self.host_header = f"{host}:{port}".encode("latin-1")

    async def acquire(self, fresh: bool = False) -> Connection:
        if not fresh:
            now = time.monotonic()
            while self.idle:
                conn = self.idle.pop()
                if conn.closed:
                    continue
                if now - conn.idle_since > self.client.idle_timeout_s:
                    conn.abort()
                    continue
                conn.reused = True
                return conn
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: Connection(self), self.host, self.port),
                self.client.connect_timeout_s,
            )
        except (OSError, TimeoutError) as error:
            failure = f"cannot connect to {self.host}:{self.port}: {error!r}"
            if isinstance(error, OSError) and error.errno in LOCAL_ERRNOS:
                raise LocalResourceError(failure) from None
            raise HttpError(failure) from None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            notice_silence(sock, self.client.connect_timeout_s)
        return conn

    def release(self, conn: Connection) -> None:
        if conn.closed or not conn.complete or not conn.keep_alive or conn.error is not None:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        if len(self.idle) > self.client.max_idle_per_origin:
            self.idle.popleft().abort()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()
