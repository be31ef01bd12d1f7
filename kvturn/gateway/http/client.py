"""A small HTTP/1.1 client for the gateway's calls to its engines, built for low overhead.

The gateway makes two or three requests to engines per turn, always to a handful of known
origins on a trusted network, always small JSON bodies with a ``Content-Length`` and
responses that vLLM (uvicorn) frames with ``Content-Length`` or chunked encoding. General
clients pay for what that traffic never needs (cookies, redirects, proxies, auth, tracing
hooks, multidict headers, several layers of streams): aiohttp's client was about 60% of the
gateway's CPU per turn. This one keeps, per origin, a pool of keep-alive connections, each an
:class:`asyncio.Protocol` fed to ``httptools`` (the C parser uvicorn uses), writes each request
in one ``write`` and wakes the caller once per response (or once per arriving chunk when
streaming).

Semantics worth knowing:

* **Errors** are :class:`HttpError` (refused, reset, closed early, malformed response,
  timeout), never a half-read response.
* **Stale connections**: an idle connection the server closed is dropped when noticed (and
  the request goes on a fresh one); idle connections older than ``idle_timeout_s`` (3 s;
  uvicorn's keep-alive is 5 s) are closed rather than reused, which keeps the race of a server
  closing a connection as a request goes out rare. A request that fails that way, on a reused
  connection before a single response byte, is sent once more on a fresh connection only if
  its method is idempotent: the server may also have failed while serving it, and a POST to
  an engine (a prefill, a decode) must not run twice. The POST's caller gets the error and
  its own fallback decides (the turn path retries as a new request where that is safe).
* **Timeouts**: ``connect_timeout_s`` to open a connection, and the longest a host may
  acknowledge nothing on an open one (sent bytes, keepalive probes while a response is
  awaited: :func:`.pool.notice_silence`), so an unplugged host fails its requests within
  seconds, not at their deadline. A whole response
  (:meth:`HttpClient.request`) must arrive within ``timeout_s``. A stream
  (:meth:`HttpClient.open`) must bring its first body bytes within ``timeout_s`` of the request,
  and then never fall silent for longer: a reasoning model's reply may stream for an hour, a
  stalled engine is noticed. ``max_stream_s`` (0: none) caps a whole stream where an operator
  wants that. A deadline that passes aborts the connection.
* **Streams** (:meth:`HttpClient.open`) deliver body bytes as they arrive (de-chunked, never
  re-framed). Reading pauses when more than ``pool.STREAM_HIGH_WATER`` bytes wait unconsumed. A
  stream closed before its end aborts the connection, which tells the server the reader left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from kvturn.gateway.http.pool import IDEMPOTENT, Connection, HttpError, Pool, Stale


class Response:
    """A complete response. Header names are lower-case."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return orjson.loads(self.body)


class StreamResponse:
    """A response whose headers arrived; its body is read as it comes. Always close it (or
    read it to the end): ``async with`` or ``await stream.aclose()``."""

    def __init__(self, pool: Pool, conn: Connection):
        self._pool = pool
        self._conn: Connection | None = conn
        self._finished = False
        self.status = conn.status
        self.headers = conn.headers

    @property
    def at_end(self) -> bool:
        """The whole body arrived and was handed out: the next ``next_chunk`` is None."""
        return self._finished

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some), or None at the
        end of the body."""
        conn = self._conn
        if conn is None:
            return None
        try:
            while not conn.chunks:
                if conn.complete:
                    self._done()
                    return None
                await conn.wait()
        except BaseException:
            self._abort()
            raise
        chunks = conn.take_chunks()
        if conn.complete:
            self._done()  # the connection goes back to the pool before the chunk is used
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        """Stop reading: a finished response frees its connection, an unfinished one aborts."""
        conn = self._conn
        if conn is None:
            return
        if conn.complete and not conn.chunks:
            self._done()
        else:
            self._abort()

    async def __aenter__(self) -> StreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _done(self) -> None:
        self._finished = True
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None

    def _abort(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            self._conn = None


class HttpClient:
    """HTTP/1.1 to a few known ``http://`` origins; one instance per event loop."""

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        timeout_s: float = 600.0,
        idle_timeout_s: float = 3.0,
        max_idle_per_origin: int = 256,
        max_stream_s: float = 0.0,
    ):
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        #: The longest a whole stream may last (0: as long as it keeps sending).
        self.max_stream_s = max_stream_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        #: "http://host:port" -> its pool
        self._pools: dict[str, Pool] = {}

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Send and read the whole response."""
        pool, conn = await self._send(method, url, body, headers, timeout_s, until_complete=True)
        response = Response(conn.status, conn.headers, b"".join(conn.take_chunks()))
        pool.release(conn)
        return response

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> StreamResponse:
        """Send and return once the response's headers arrived; the body streams."""
        pool, conn = await self._send(method, url, body, headers, timeout_s, until_complete=False)
        return StreamResponse(pool, conn)

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
        until_complete: bool,
    ) -> tuple[Pool, Connection]:
        """One exchange on a pooled connection; once more on a fresh one if the reused
        connection turned out dead before any response byte and sending again is safe: it
        was found closed before the request went out, or the method is idempotent. A POST
        that went out is never sent twice (the engine may have received it: a prefill or a
        decode would run twice); its caller gets the error."""
        pool, path = self._route(url)
        payload = _encode(method, path, pool.host_header, body, headers)
        conn = await pool.acquire()
        try:
            await self._exchange(pool, conn, payload, timeout_s, until_complete)
        except Stale as stale:
            if not (stale.before_sending or method in IDEMPOTENT):
                raise HttpError(str(stale)) from None
            conn = await pool.acquire(fresh=True)
            await self._exchange(pool, conn, payload, timeout_s, until_complete)
        return pool, conn

    async def _exchange(
        self,
        pool: Pool,
        conn: Connection,
        payload: bytes,
        timeout_s: float | None,
        until_complete: bool,
    ) -> None:
        try:
            if conn.closed:
                if conn.reused:
                    raise Stale("connection closed", before_sending=True)
                raise HttpError("connection closed")
            streaming = not until_complete
            max_s = self.max_stream_s if streaming else 0.0
            conn.start(
                payload, timeout_s or self.timeout_s, pool.loop, streaming=streaming, max_s=max_s
            )
            while not (conn.complete if until_complete else conn.headers_done):
                await conn.wait()
        except BaseException:
            conn.abort()
            raise

    def _route(self, url: str) -> tuple[Pool, str]:
        slash = url.find("/", 7)
        prefix = url if slash < 0 else url[:slash]
        path = "/" if slash < 0 else url[slash:]
        pool = self._pools.get(prefix)
        if pool is None:
            pool = self._pools[prefix] = self._new_pool(prefix)
        return pool, path

    def _new_pool(self, prefix: str) -> Pool:
        if not prefix.startswith("http://"):
            raise HttpError(f"only http:// URLs are supported: {prefix!r}")
        hostport = prefix[7:]
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            host, port = hostport, "80"
        host = host.strip("[]")
        return Pool(self, host, int(port))

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _encode(
    method: str,
    path: str,
    host: bytes,
    body: bytes | None,
    headers: Mapping[str, str] | None,
) -> bytes:
    head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"host: ", host, b"\r\n"]
    if body is not None:
        head.append(b"content-length: %d\r\n" % len(body))
    if headers:
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if "\r" in line[:-2] or "\n" in line[:-2]:
                raise ValueError(f"header {name!r} contains a line break")
            head.append(line.encode("latin-1"))
    head.append(b"\r\n")
    if body:
        head.append(body)
    return b"".join(head)
