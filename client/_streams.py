"""Stream classes that end a turn when the stream is exhausted or closed.

The client makes the streams of conversation requests tracked ones, so whichever path builds
the stream (a plain ``create(stream=True)``, or ``with_raw_response`` parsed later) the pause
starts when the reply really ends, not when its headers arrive: a stream the SDK built becomes
one (its class is swapped for the tracked subclass, which adds only methods), and a raw
response is given the tracked class to build its stream with.

They replace ``__iter__``/``__next__`` (and their async twins) rather than wrap
``__stream__``: iterating one costs no more generator layers per chunk than a plain stream,
only the tool-call check. The reply ends when the SDK's own iterator is exhausted or fails, on
``close()``, or when an abandoned stream is collected (as an abandoned generator's ``finally``
would); leaving a ``for`` loop early does not end it (the stream can go on).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar, get_origin

from openai import AsyncStream, Stream
from openai._streaming import extract_stream_chunk_type
from openai.types.chat import ChatCompletionChunk

from kvturn.headers import TURN_ID

from ._conversation import Turn
from ._replies import asks_for_tools

__all__ = [
    "TrackedAsyncStream",
    "TrackedStream",
    "tracked_classes",
    "tracked_stream_cls",
]

_T = TypeVar("_T")


def _choice_calls_tools(choice: Any) -> bool:
    return choice.finish_reason == "tool_calls" or bool(choice.delta.tool_calls)


def _end_turn(stream: TrackedStream[Any] | TrackedAsyncStream[Any]) -> None:
    if stream._kvturn_ended:
        return
    stream._kvturn_ended = True
    client: Any = stream._client
    turn = stream._kvturn_turn
    if turn is None:
        # Built after its request returned (with_raw_response): find the turn by its id.
        turn = client._kvturn_open_turn(stream.response.request.headers.get(TURN_ID))
        if turn is None:
            return
    client._kvturn_finish(turn, stream._kvturn_tools)


class TrackedStream(Stream[_T]):
    """A ``Stream`` that reports the end of its reply to the kvturn client."""

    #: The turn, set by the client when its request returns the stream (else found by id).
    _kvturn_turn: Turn | None = None
    _kvturn_tools: bool = False
    _kvturn_ended: bool = False

    def __next__(self) -> _T:
        try:
            item = self._iterator.__next__()
        except BaseException:  # exhausted (StopIteration) or failed: the reply is over
            _end_turn(self)
            raise
        if not self._kvturn_tools and asks_for_tools(item):
            self._kvturn_tools = True
        return item

    def __iter__(self) -> Iterator[_T]:
        # The same generator over the SDK's iterator as Stream.__iter__ (not ``yield from``,
        # which would close it when the caller leaves a loop early), plus the tool-call check
        # of each item up to the first that calls tools.
        iterator: Iterator[Any] = self._iterator
        try:
            if not self._kvturn_tools:
                tools = False
                if self._cast_to is ChatCompletionChunk:
                    for item in iterator:
                        for choice in item.choices:  # asks_for_tools(), inline: per chunk
                            if choice.finish_reason or choice.delta.tool_calls:
                                tools = tools or _choice_calls_tools(choice)
                        if tools:
                            self._kvturn_tools = True
                            yield item
                            break
                        yield item
                else:
                    for item in iterator:
                        if asks_for_tools(item):
                            self._kvturn_tools = True
                            yield item
                            break
                        yield item
            for item in iterator:
                yield item
        except GeneratorExit:  # the caller left the loop: the stream itself goes on
            raise
        except BaseException:
            _end_turn(self)
            raise
        turn = self._kvturn_turn
        if turn is not None and not self._kvturn_ended:  # _end_turn(), its common case inline
            self._kvturn_ended = True
            client: Any = self._client
            client._kvturn_finish(turn, self._kvturn_tools)
            # Done: a plain stream again, which spares its collection the finalizer call.
            self.__class__ = Stream  # type: ignore[assignment]
        else:
            _end_turn(self)

    def close(self) -> None:
        """Close the response; the reply (and so the turn) ends here if not before."""
        try:
            super().close()
        finally:
            _end_turn(self)

    def __del__(self) -> None:
        if not self._kvturn_ended:
            with contextlib.suppress(AttributeError):  # its construction failed: no turn
                _end_turn(self)


class TrackedAsyncStream(AsyncStream[_T]):
    """An ``AsyncStream`` that reports the end of its reply to the kvturn client."""

    _kvturn_turn: Turn | None = None
    _kvturn_tools: bool = False
    _kvturn_ended: bool = False

    async def __anext__(self) -> _T:
        try:
            item = await self._iterator.__anext__()
        except BaseException:  # exhausted (StopAsyncIteration), failed or cancelled
            _end_turn(self)
            raise
        if not self._kvturn_tools and asks_for_tools(item):
            self._kvturn_tools = True
        return item

    async def __aiter__(self) -> AsyncIterator[_T]:
        # As TrackedStream.__iter__.
        iterator: AsyncIterator[Any] = self._iterator
        try:
            if not self._kvturn_tools:
                tools = False
                if self._cast_to is ChatCompletionChunk:
                    async for item in iterator:
                        for choice in item.choices:  # asks_for_tools(), inline: per chunk
                            if choice.finish_reason or choice.delta.tool_calls:
                                tools = tools or _choice_calls_tools(choice)
                        if tools:
                            self._kvturn_tools = True
                            yield item
                            break
                        yield item
                else:
                    async for item in iterator:
                        if asks_for_tools(item):
                            self._kvturn_tools = True
                            yield item
                            break
                        yield item
            async for item in iterator:
                yield item
        except GeneratorExit:  # the caller left the loop: the stream itself goes on
            raise
        except BaseException:
            _end_turn(self)
            raise
        turn = self._kvturn_turn
        if turn is not None and not self._kvturn_ended:  # _end_turn(), its common case inline
            self._kvturn_ended = True
            client: Any = self._client
            client._kvturn_finish(turn, self._kvturn_tools)
            # Done: a plain stream again, which spares its collection the finalizer call.
            self.__class__ = AsyncStream  # type: ignore[assignment]
        else:
            _end_turn(self)

    async def close(self) -> None:
        """Close the response; the reply (and so the turn) ends here if not before."""
        try:
            await super().close()
        finally:
            _end_turn(self)

    def __del__(self) -> None:
        if not self._kvturn_ended:
            with contextlib.suppress(AttributeError):  # its construction failed: no turn
                _end_turn(self)


# Tracked classes by the SDK's stream class (``Stream[X]``), made once (None for a class of the
# caller's own). Each is a concrete
# subclass of TrackedStream whose ``__orig_bases__`` names ``Stream[X]``: the SDK reads the
# chunk type from there (as for any ``class MyStream(Stream[X])``) and constructs it directly,
# where a ``TrackedStream[X]`` alias would cost a typing call and a longer type lookup per
# request. Keyed by id(): hashing a typing alias runs Python code (the entry keeps the alias
# alive, so its id is not reused).
tracked_classes: dict[int, tuple[Any, Any]] = {}


def tracked_stream_cls(stream_cls: Any, *, asynchronous: bool) -> Any | None:
    """The tracked equivalent of ``Stream[X]``/``AsyncStream[X]``; ``None`` for custom classes,
    whose behaviour a swap would lose (their turn then ends when the request returns)."""
    cached = tracked_classes.get(id(stream_cls))
    if cached is not None and cached[0] is stream_cls:
        return cached[1]
    if stream_cls is None:
        return None
    base = AsyncStream if asynchronous else Stream
    if (get_origin(stream_cls) or stream_cls) is not base:
        tracked_classes[id(stream_cls)] = (stream_cls, None)  # the answer is kept too
        return None
    chunk = extract_stream_chunk_type(stream_cls)
    generic = TrackedAsyncStream if asynchronous else TrackedStream
    tracked = type(
        f"{generic.__name__}[{getattr(chunk, '__name__', chunk)}]",
        (generic,),
        {"__orig_bases__": (stream_cls,), "__module__": __name__},
    )
    tracked_classes[id(stream_cls)] = (stream_cls, tracked)
    return tracked
