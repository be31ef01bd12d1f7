"""One request's exchange with the ASGI app, and the bytes of its reply: the ASGI scope,
``receive`` and ``send``, the reply's head and framing (``Content-Length``, chunked, or closed
after for HTTP/1.0), and the replies the server makes itself. Reading requests off the
connection is :mod:`.connection`'s."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import orjson

from kvturn.gateway.errors import GatewayError, error_body

logger = logging.getLogger("kvturn.gateway")

#: An ASGI application (scope, receive, send), as the server calls it.
ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]

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
_ASGI_VERSION = {"version": "3.0", "spec_version": "2.3"}
_UNSAFE_VALUE = re.compile(rb"[\r\n\x00]")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


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


def _frame(body: bytes, more: bool) -> bytes:
    framed = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
    return framed if more else framed + b"0\r\n\r\n"


class Request:
    """A request read off a connection, whole (or refused while it was being read)."""

    __slots__ = (
        "body", "budget_key", "headers", "held", "keep_alive", "method", "refusal", "url",
        "version",
    )  # fmt: skip

    def __init__(self) -> None:
        self.method = ""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.keep_alive = True
        self.version = "1.1"
        #: The error it was refused with while it was being read.
        self.refusal: GatewayError | None = None
        #: Body bytes counted against the server's budget until the request is served, and
        #: the caller's share they count against (``None``: the server's budget alone).
        self.held = 0
        self.budget_key: str | None = None


class ReplyWriter:
    """Writes one connection's replies: waits while the transport's buffer is over its high
    water mark (back-pressure on a slow reader), and writes nothing once the connection is
    gone."""

    __slots__ = ("_drained", "_loop", "closed", "paused", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: Any = None
        self.closed = False
        self.paused = False
        self._drained: asyncio.Future[None] | None = None

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake()

    def lost(self) -> None:
        """The connection is gone: a writer waiting to drain goes on (and writes nothing)."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        while self.paused and not self.closed:
            self._drained = self._loop.create_future()
            await self._drained
        self._drained = None

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def write_json(
        self, request: Request, status: int, body: bytes, retry_after_s: int | None = None
    ) -> None:
        """A reply the server makes itself (a refused request, an error the app did not
        answer), with a ``Retry-After`` header when ``retry_after_s`` is given."""
        if self.closed:
            return
        head = [_status_line(status), b"date: ", _date(), b"\r\n"]
        if not request.keep_alive:
            head.append(b"connection: close\r\n")
        if retry_after_s is not None:
            head.append(b"retry-after: %d\r\n" % retry_after_s)
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        head.append(body)
        self.transport.write(b"".join(head))


async def serve_asgi(
    app: ASGIApp,
    request: Request,
    writer: ReplyWriter,
    gone: asyncio.Future[None],
    addresses: tuple[tuple[str, int] | None, tuple[str, int] | None],
    reply_started: Callable[[], None] | None = None,
) -> None:
    """``request`` through ``app``, its reply written by ``writer``; ``gone`` resolves when
    the client leaves; ``addresses`` are the client's and the server's; ``reply_started()``
    is called as the reply starts."""
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
        "client": addresses[0],
        "server": addresses[1],
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
        await asyncio.shield(gone)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal chunked
        if writer.closed:
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
            writer.write(b"".join(head) + (_frame(body, more) if chunked else body))
        elif chunked:
            writer.write(_frame(body, more))
        else:
            writer.write(body)
        if writer.paused:
            await writer.drain()

    try:
        await app(scope, receive, send)
    except Exception:
        logger.exception("unexpected error serving %s %s", request.method, scope["path"])
        if chunked is None and not writer.closed:
            error = orjson.dumps(error_body("internal gateway error", "server_error"))
            writer.write_json(request, 500, error)
        else:
            request.keep_alive = False
    else:
        if chunked is None and not writer.closed:  # the app sent no body at all
            request.keep_alive = False
