"""Stream classes that end a turn when the stream is exhausted or closed.

The client swaps these in for ``Stream[X]``/``AsyncStream[X]`` on conversation requests, so
whichever path builds the stream (a plain ``create(stream=True)``, or ``with_raw_response``
parsed later) the pause starts when the reply really ends, not when its headers arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol, TypeVar, cast, get_origin

from openai import AsyncStream, Stream
from openai._streaming import extract_stream_chunk_type

from kvturn.headers import TURN_ID

from ._conversation import Turn
from ._replies import asks_for_tools

__all__ = ["TrackedAsyncStream", "TrackedStream", "tracked_stream_cls"]

_T = TypeVar("_T")


class _TurnOwner(Protocol):
    def _kvturn_open_turn(self, turn_id: str | None) -> Turn | None: ...
    def _kvturn_finish(self, turn: Turn, *, tool_calls: bool) -> None: ...


class TrackedStream(Stream[_T]):
    """A ``Stream`` that reports the end of its reply to the kvturn client."""

    _kvturn_turn: Turn | None
    _kvturn_tools: bool

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvturn_turn = _find_turn(self)
        self._kvturn_tools = False

    def __stream__(self) -> Iterator[_T]:
        try:
            for item in super().__stream__():
                if not self._kvturn_tools and asks_for_tools(item):
                    self._kvturn_tools = True
                yield item
        finally:
            self._kvturn_end()

    def close(self) -> None:
        """Close the response; the reply (and so the turn) ends here if not before."""
        try:
            super().close()
        finally:
            self._kvturn_end()

    def _kvturn_end(self) -> None:
        turn, self._kvturn_turn = self._kvturn_turn, None
        if turn is not None:
            cast(_TurnOwner, self._client)._kvturn_finish(turn, tool_calls=self._kvturn_tools)


class TrackedAsyncStream(AsyncStream[_T]):
    """An ``AsyncStream`` that reports the end of its reply to the kvturn client."""

    _kvturn_turn: Turn | None
    _kvturn_tools: bool

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvturn_turn = _find_turn(self)
        self._kvturn_tools = False

    async def __stream__(self) -> AsyncIterator[_T]:
        try:
            async for item in super().__stream__():
                if not self._kvturn_tools and asks_for_tools(item):
                    self._kvturn_tools = True
                yield item
        finally:
            self._kvturn_end()

    async def close(self) -> None:
        """Close the response; the reply (and so the turn) ends here if not before."""
        try:
            await super().close()
        finally:
            self._kvturn_end()

    def _kvturn_end(self) -> None:
        turn, self._kvturn_turn = self._kvturn_turn, None
        if turn is not None:
            cast(_TurnOwner, self._client)._kvturn_finish(turn, tool_calls=self._kvturn_tools)


def _find_turn(stream: Stream[Any] | AsyncStream[Any]) -> Turn | None:
    owner = cast(_TurnOwner, stream._client)
    turn = owner._kvturn_open_turn(None)
    if turn is None:
        turn = owner._kvturn_open_turn(stream.response.request.headers.get(TURN_ID))
    return turn


# Tracked classes by the SDK's stream class, resolved once rather than per request. They stay
# ``TrackedStream[X]`` aliases: the SDK reads the chunk type from the alias's direct base.
_tracked_classes: dict[Any, Any] = {}


def tracked_stream_cls(stream_cls: Any, *, asynchronous: bool) -> Any | None:
    """The tracked equivalent of ``Stream[X]``/``AsyncStream[X]``; ``None`` for custom classes,
    whose behaviour a swap would lose (their turn then ends when the request returns)."""
    if stream_cls is None:
        return None
    tracked = _tracked_classes.get(stream_cls)
    if tracked is not None:
        return tracked
    base = AsyncStream if asynchronous else Stream
    if (get_origin(stream_cls) or stream_cls) is not base:
        return None
    chunk = extract_stream_chunk_type(stream_cls)
    generic = TrackedAsyncStream if asynchronous else TrackedStream
    tracked = generic[chunk]  # type: ignore[index]
    _tracked_classes[stream_cls] = tracked
    return tracked
