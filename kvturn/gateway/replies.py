"""What the turn path answers, and how it goes out over raw ASGI.

The turn endpoints are the gateway's hot path: they skip Starlette's response classes (and,
for streams, the task group Starlette runs per streamed response) and send ASGI messages
directly. A reply that is whole when it goes out (a JSON body, or a stream that arrived at
once) is one ``http.response.body`` message: the server writes it with its head at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from kvturn.gateway.errors import GatewayError

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"  # as vLLM says it


class ReplyStream(Protocol):
    """A streamed reply body."""

    @property
    def at_end(self) -> bool:
        """Everything was handed out: the next ``next_chunk`` returns None."""

    async def next_chunk(self) -> bytes | None:
        """The next bytes to send as they arrived, or None at the end."""

    async def aclose(self) -> None:
        """Called exactly once when the relay ends, however it ends."""


@dataclass(slots=True)
class Reply:
    """A response: a JSON body, or ``stream``, relayed as it comes (server-sent events)."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    stream: ReplyStream | None = None


class _SseChunks:
    """A server-sent event stream that arrives in arbitrary chunks (events may span chunks)."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def _complete(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes (with what came before it)."""
        events = (self._tail + chunk).split(b"\n\n")
        self._tail = events.pop()
        return events


class SseData(_SseChunks):
    """The ``data:`` payloads of a server-sent event stream: each complete event's payload,
    ``[DONE]`` and blank ones left out. What a payload holds (JSON, as vLLM sends it) is the
    caller's to parse."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> list[bytes]:
        payloads = []
        for event in self._complete(chunk):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload and payload != b"[DONE]":
                        payloads.append(payload)
        return payloads


class SseEvents(_SseChunks):
    """Server-sent events, each complete one with its data: its JSON object, ``"done"`` for
    ``[DONE]``, or ``None`` (no data, or not a JSON object); blank events left out. For a
    relay that passes events on (:class:`SseData` gives payloads only)."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> list[tuple[bytes, Any]]:
        found: list[tuple[bytes, Any]] = []
        for event in self._complete(chunk):
            data = b"".join(
                line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")
            )
            payload: Any = None
            if data == b"[DONE]":
                payload = "done"
            elif data:
                try:
                    payload = orjson.loads(data)
                except orjson.JSONDecodeError:
                    payload = None
                if not isinstance(payload, dict):
                    payload = None
            if event.strip():
                found.append((event, payload))
        return found


def failure_event(payload: dict[str, Any]) -> bool:
    """Whether a stream's event reports a failure while generating (an error of a 5xx, or
    without a code): the reply can be served again or continued elsewhere. An error about the
    request itself (4xx) is the client's to see, relayed as it came."""
    if "error" not in payload:
        return False
    error = payload["error"]
    code = error.get("code") if isinstance(error, dict) else None
    return not (isinstance(code, int) and code < 500)


def error_reply(error: GatewayError) -> Reply:
    return Reply(error.status, orjson.dumps(error.body()), error.headers())


async def send_reply(reply: Reply, receive: Any, send: Any) -> None:
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    if reply.stream is None:
        headers = [(b"content-type", _JSON), (b"content-length", b"%d" % len(reply.body)), *extra]
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})
        return
    await _relay(reply.stream, reply.status, extra, receive, send)


async def _relay(
    stream: ReplyStream,
    status: int,
    extra: list[tuple[bytes, bytes]],
    receive: Any,
    send: Any,
) -> None:
    """Pass each chunk on as it arrives (the last one ends the response); stop as soon as the
    client has gone. Who is gone is learnt from ``receive()`` (``http.disconnect``), watched
    only once the reply spans several reads, so a reply that arrived whole costs no task."""
    gone: asyncio.Task[Any] | None = None
    try:
        headers = [(b"content-type", _SSE), (b"cache-control", b"no-cache"), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        while True:
            chunk = await stream.next_chunk()
            if chunk is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            last = stream.at_end
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
            if gone is None:
                gone = asyncio.get_running_loop().create_task(receive())
            elif gone.done():
                return
    finally:
        if gone is not None:
            gone.cancel()
        await stream.aclose()
