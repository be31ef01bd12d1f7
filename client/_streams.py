"""When a reply ends, and whether a streamed one called tools.

A turn ends when its reply does (:func:`reply_returned`; ``request()`` has its common cases
inline): a read body when ``request()`` returns; a stream, or a body left to read, when its
HTTP response closes, not when its headers arrive. Every way a stream of the SDK ends goes
through its HTTP response's ``close()``/``aclose()``: exhausted (the SDK closes the response
after the last event), failed, closed by the caller, or left unfinished and collected (its
generator's ``finally`` closes it). So the client replaces that method on the one response
of a streamed turn with the turn's own, which ends the turn, removes itself (the SDK closes a
finished stream two or three times: the later calls are the response's own) and closes the
response. A response collected without ever being closed (a stream dropped before it was
iterated) ends its turn too, through a weak reference. Whatever class the stream is,
iterating it costs what it costs with the plain client.

Tool calls are noticed as the events are decoded, before the SDK parses them: a stream made
while a turn is being sent gets a decoder (:class:`WatchingDecoder`) that looks for
``"_call"`` in each event's text and parses only the events that hold it. The chunks are not
read: every attribute read on a pydantic model goes through its ``__getattr__`` hook.

A raw response's stream (``with_raw_response``, LangChain's path) is built later, when the
caller parses it: it is given a class (:func:`late_stream_cls`) that finds its turn on the
response and watches its events the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any, get_origin

import openai
from openai import APIResponse, AsyncAPIResponse, AsyncStream, Stream
from openai._base_client import BaseClient
from openai._streaming import ServerSentEvent, SSEDecoder, extract_stream_chunk_type

from ._conversation import Turn, finish_turn
from ._replies import TOOL_MARK, event_asks_for_tools, result_asks_for_tools

__all__ = [
    "SDK_DECODER_IS_PLAIN",
    "WatchingDecoder",
    "WatchingWrapper",
    "late_stream_cls",
    "reply_returned",
    "turn_of",
]


def _sdk_decoder_is_plain() -> bool:
    """Whether the SDK decodes events as this module's fast path assumes: its clients make a
    plain ``SSEDecoder``, which decodes each network chunk's lines in ``_decode_lines`` into
    events that keep their text in ``_data``. Otherwise (another SDK version) the client's own
    decoder is wrapped, which costs one more generator step per event."""
    makes_plain = (
        openai.OpenAI._make_sse_decoder is BaseClient._make_sse_decoder
        and openai.AsyncOpenAI._make_sse_decoder is BaseClient._make_sse_decoder
    )
    decode_lines = getattr(SSEDecoder, "_decode_lines", None)
    uses_decode_lines = all(
        "_decode_lines"
        in getattr(getattr(getattr(SSEDecoder, name, None), "__code__", None), "co_names", ())
        for name in ("iter_bytes", "aiter_bytes")
    )
    try:
        keeps_data = ServerSentEvent(data="x")._data == "x"
    except Exception:
        keeps_data = False
    return makes_plain and decode_lines is not None and uses_decode_lines and keeps_data


SDK_DECODER_IS_PLAIN = _sdk_decoder_is_plain()


class WatchingDecoder(SSEDecoder):
    """The SDK's SSE decoder, noting on its turn when an event calls tools.

    Made as the SDK's is (no arguments), then given its turn: ``_kvturn_turn``.
    """

    _kvturn_turn: Turn

    def _decode_lines(self, lines: Iterator[bytes]) -> Iterator[ServerSentEvent]:
        # SSEDecoder._decode_lines, plus the look at each event's text. (Called once per
        # network chunk, which mostly holds one event: the turn is not kept in a local.)
        for raw_line in lines:
            sse = self.decode(raw_line.decode("utf-8"))
            if sse:
                if (
                    not self._kvturn_turn.tools_seen
                    and TOOL_MARK in sse._data
                    and event_asks_for_tools(sse._data)
                ):
                    self._kvturn_turn.tools_seen = True
                yield sse


class WatchingWrapper:
    """Any SSE decoder (the client's own), noting on its turn when an event calls tools."""

    def __init__(self, decoder: Any, turn: Turn) -> None:
        self._decoder = decoder
        self._turn = turn

    def _saw(self, sse: Any) -> None:
        data = sse.data
        if not self._turn.tools_seen and TOOL_MARK in data and event_asks_for_tools(data):
            self._turn.tools_seen = True

    def iter_bytes(self, iterator: Iterator[bytes]) -> Iterator[ServerSentEvent]:
        for sse in self._decoder.iter_bytes(iterator):
            self._saw(sse)
            yield sse

    async def aiter_bytes(self, iterator: AsyncIterator[bytes]) -> AsyncIterator[ServerSentEvent]:
        async for sse in self._decoder.aiter_bytes(iterator):
            self._saw(sse)
            yield sse


def watching(decoder: Any, turn: Turn) -> Any:
    """``decoder`` (unused, not yet started) replaced by one that watches for ``turn``."""
    if SDK_DECODER_IS_PLAIN and type(decoder) is SSEDecoder:
        watching_decoder = WatchingDecoder()
        watching_decoder._kvturn_turn = turn
        return watching_decoder
    return WatchingWrapper(decoder, turn)


def reply_returned(
    turn: Turn, result: Any, streamed: bool, raw_response: bool, asynchronous: bool
) -> None:
    """``request()`` returned ``result`` for ``turn``: end the turn now, or make the closing of
    the reply's HTTP response end it (a stream, or a body not read yet)."""
    response: Any
    if streamed:
        if isinstance(result, (Stream, AsyncStream)):
            response = result.response
        elif raw_response:  # its stream is built when the caller parses it
            response = getattr(result, "http_response", None)
        else:  # not a stream after all: nothing will tell when the reply ends
            response = None
    elif isinstance(result, (APIResponse, AsyncAPIResponse)):
        response = result.http_response  # with_streaming_response: the body is read later
    else:
        finish_turn(turn, result_asks_for_tools(result))
        return
    if response is not None:
        try:
            if asynchronous:
                response.aclose = turn._aend_reply
            else:
                response.close = turn._end_reply
            turn._response = weakref.ref(response, turn._response_gone)
            return
        except (AttributeError, TypeError):  # an HTTP response class without a __dict__
            pass
    finish_turn(turn, turn.tools_seen)


def turn_of(response: Any) -> Turn | None:
    """The turn whose end ``response`` is hooked to, if any."""
    hooks = getattr(response, "__dict__", {})
    hook = hooks.get("close") or hooks.get("aclose")
    turn = getattr(hook, "__self__", None)
    return turn if type(turn) is Turn else None


class _LateStream(Stream[Any]):
    """A raw response's stream, built when the caller parses it: watches for its turn."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        turn = turn_of(self.response)
        if turn is not None:
            self._decoder = watching(self._decoder, turn)


class _LateAsyncStream(AsyncStream[Any]):
    """The async twin of :class:`_LateStream`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        turn = turn_of(self.response)
        if turn is not None:
            self._decoder = watching(self._decoder, turn)


# Late classes by the SDK's stream class (``Stream[X]``), made once (None for a class of the
# caller's own). Each is a concrete subclass whose ``__orig_bases__`` names ``Stream[X]``: the
# SDK reads the chunk type from there, as for any ``class MyStream(Stream[X])``. Keyed by id():
# hashing a typing alias runs Python code (the entry keeps the alias alive, so its id is not
# reused).
_late_classes: dict[int, tuple[Any, Any]] = {}


def late_stream_cls(stream_cls: Any, *, asynchronous: bool) -> Any | None:
    """The class a raw response builds its ``Stream[X]``/``AsyncStream[X]`` with; ``None`` for
    a class of the caller's own (kept: its events then go unwatched)."""
    cached = _late_classes.get(id(stream_cls))
    if cached is not None and cached[0] is stream_cls:
        return cached[1]
    if stream_cls is None:
        return None
    base = AsyncStream if asynchronous else Stream
    late: Any = None
    if (get_origin(stream_cls) or stream_cls) is base:
        chunk = extract_stream_chunk_type(stream_cls)
        generic = _LateAsyncStream if asynchronous else _LateStream
        late = type(
            f"{generic.__name__}[{getattr(chunk, '__name__', chunk)}]",
            (generic,),
            {"__orig_bases__": (stream_cls,), "__module__": __name__},
        )
    _late_classes[id(stream_cls)] = (stream_cls, late)
    return late
