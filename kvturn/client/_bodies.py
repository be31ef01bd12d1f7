"""Watching a reply's body as the HTTP client reads it: when it ends, and whether it calls tools.

A turn ends when its reply does, and every reply, whatever the SDK makes of it (a parsed
completion, a ``Stream``, ``with_raw_response``, ``with_streaming_response``), is read from the
HTTP response's byte stream and ends when the HTTP client closes that stream: read to the end,
closed early, or failed. So the client's response hook (``_hooks.py``) puts a watcher around
each answer's ``response.stream`` (the byte stream httpx and httpx2 read a body from, the one
a custom transport hands them): :class:`WatchedStream` for sync clients,
:class:`AsyncWatchedStream` for async ones. It passes the bytes on unchanged, looks at them for
tool calls on the way, and ends the turn when it is closed, or, for a response dropped unread,
when it is collected.

A JSON body is not watched: the SDK reads it whole at once, so the response hook reads it
itself (``response.read()``; the SDK then gets the same bytes) and :func:`body_read` ends the
turn. Tool calls are read from the text: a JSON body whole, a streamed reply (server-sent
events) line by line as it goes by, and only text that holds :data:`~._replies.TOOL_MARK` is
looked at more closely. A stream compressed with gzip or deflate is inflated for the look;
other encodings are passed on unread (their tool calls then go unseen: the pause after them is
reported as a user pause unless an adapter reports the tool).
"""

from __future__ import annotations

import contextlib
import importlib
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from ._conversation import Turn, finish_turn
from ._replies import TOOL_MARK, event_asks_for_tools

__all__ = ["AsyncWatchedStream", "WatchedStream", "body_read"]

_MARK = TOOL_MARK.encode("ascii")
#: A streamed event line longer than this is not looked at for tool calls.
MAX_WATCHED_BYTES = 8 << 20


def _byte_stream_bases(kind: str) -> tuple[type, ...]:
    # httpx's and httpx2's responses accept, as their stream, only an instance of the library's
    # own SyncByteStream/AsyncByteStream: the watchers are both, whichever are installed
    # (openai 1.x and 2.x use httpx, 3.x httpx2 and also accepts an httpx client).
    bases = []
    for name in ("httpx2", "httpx"):
        try:
            bases.append(getattr(importlib.import_module(name), kind))
        except ImportError:
            continue
    if not bases:
        raise ImportError("kvturn.client needs httpx or httpx2 (the openai SDK brings one)")
    return tuple(bases)


SyncByteStreams: Any = type("SyncByteStreams", _byte_stream_bases("SyncByteStream"), {})
AsyncByteStreams: Any = type("AsyncByteStreams", _byte_stream_bases("AsyncByteStream"), {})


def _inflater(encoding: str | None) -> Callable[[bytes], bytes] | None:
    """What turns the body's bytes as sent into text: ``None`` for none needed; raises
    ``LookupError`` for an encoding this module does not read."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return None
    if encoding.strip().lower() in ("gzip", "x-gzip", "deflate"):
        # 32 + window bits: a gzip or zlib header, found out from the data.
        return zlib.decompressobj(zlib.MAX_WBITS | 32).decompress
    raise LookupError(encoding)


def _lines_ask_for_tools(lines: bytes) -> bool:
    for line in lines.split(b"\n"):
        if (
            _MARK in line
            and line.startswith(b"data:")
            and event_asks_for_tools(line[5:].decode("utf-8", "replace"))
        ):
            return True
    return False


def body_read(turn: Turn, body: bytes) -> None:
    """A whole body (decoded) was read: the turn ends, having called tools or not."""
    tools = False
    if _MARK in body:
        events = turn.answer is not None and "event-stream" in turn.answer.get("content-type", "")
        text = body.decode("utf-8", "replace")
        tools = _lines_ask_for_tools(body) if events else event_asks_for_tools(text)
    finish_turn(turn, tools)


class BodyWatch:
    """What the sync and async watchers share: the turn, the look for tool calls, the end."""

    def __init__(
        self, stream: Any, turn: Turn, headers: Mapping[str, str], content_type: str
    ) -> None:
        self._stream = stream
        self._turn = turn
        self._ended = False
        #: Whether the body has called tools so far.
        self.tools_seen = False
        #: Whether the bytes still need looking at: the events of a stream, until one calls
        #: tools (other bodies that are not JSON, read by the hook, hold no tool calls).
        self.watching = "text/event-stream" in content_type
        # The last line, not yet complete.
        self._pending = b""
        try:
            self._inflate = _inflater(headers.get("content-encoding"))
        except LookupError:
            self._inflate = None
            self.watching = False

    def saw(self, chunk: bytes) -> None:
        """Look at the next bytes of a stream for tool calls."""
        if self._inflate is not None:
            try:
                chunk = self._inflate(chunk)
            except zlib.error:
                self.watching = False
                return
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n") + 1
        if cut:
            if data.find(_MARK, 0, cut) >= 0 and _lines_ask_for_tools(data[:cut]):
                self.tools_seen = True
                self.watching = False
            data = data[cut:]
        self._pending = data if len(data) <= MAX_WATCHED_BYTES else b""

    def end(self) -> None:
        """The body is closed (read, closed early, failed) or collected: the turn ends."""
        if self._ended:
            return
        self._ended = True
        if self.watching and _MARK in self._pending and _lines_ask_for_tools(self._pending):
            self.tools_seen = True
        finish_turn(self._turn, self.tools_seen)

    def __del__(self) -> None:
        # A response dropped without being closed (a stream never iterated) ends its turn too.
        if not self._ended:
            with contextlib.suppress(Exception):  # (nothing to tell in a finalizer)
                self.end()


class WatchedStream(SyncByteStreams, BodyWatch):
    """A sync response's byte stream, watched for its turn."""

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            if self.watching:
                self.saw(chunk)
            yield chunk

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self.end()


class AsyncWatchedStream(AsyncByteStreams, BodyWatch):
    """An async response's byte stream, watched for its turn."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            if self.watching:
                self.saw(chunk)
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self.end()
