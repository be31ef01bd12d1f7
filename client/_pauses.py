"""Pause tracking: how long a conversation sat idle between a reply and the next request.

A pause runs from the end of a reply (a non-streamed return, or a stream exhausted or closed)
to the start of the next request in the same conversation. It is a *tool* pause when the reply
asked for tool calls (or an adapter saw a tool start), otherwise a *user* pause. With parallel
requests the conversation only counts as paused while nothing is in flight.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvturn.headers import PauseKind

from ._clock import Clock

__all__ = ["Pause", "PauseTracker"]


@dataclass(frozen=True, slots=True)
class Pause:
    """A measured pause: its length and what it was spent on."""

    ms: int
    kind: PauseKind


class PauseTracker:
    """The pause clock of one conversation. Thread-safe: sync clients may share a
    conversation between threads, and streams end on whichever thread closes them."""

    __slots__ = ("_clock", "_in_flight", "_lock", "_reply_ended_at", "_tool_pending", "begun")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        # None until the first reply ends, and again once a request has consumed the pause.
        self._reply_ended_at: float | None = None
        self._tool_pending = False
        #: Requests started so far (the conversation's turn count).
        self.begun = 0

    @property
    def in_flight(self) -> int:
        """Requests of this conversation started and not yet finished."""
        return self._in_flight

    def begin_request(self) -> Pause | None:
        """A request starts: return the pause before it (``None`` on a first or parallel turn)."""
        pause = self.begin_turn()
        return None if pause is None else Pause(*pause)

    def begin_turn(self) -> tuple[int, PauseKind] | None:
        """:meth:`begin_request`, the pause as ``(ms, kind)``: the client's per-request path,
        which makes a :class:`Pause` only when someone looks at it."""
        now = self._clock()
        # Explicit acquire/release: a ``with`` block costs more than the work it guards here.
        lock = self._lock
        lock.acquire()
        try:
            ended_at = self._reply_ended_at
            tool = self._tool_pending
            # The pause is consumed: a second request started before any reply ends is parallel
            # to this one, not paused.
            self._reply_ended_at = None
            self._tool_pending = False
            self._in_flight += 1
            self.begun += 1
        finally:
            lock.release()
        if ended_at is None:
            return None
        ms = round((now - ended_at) * 1000)
        return (ms if ms > 0 else 0, "tool" if tool else "user")

    def end_reply(self, tool_calls: bool) -> float | None:
        """A reply ended. Returns when the pause started if the conversation is now idle."""
        now = self._clock()
        lock = self._lock
        lock.acquire()
        try:
            in_flight = self._in_flight - 1 if self._in_flight > 0 else 0
            self._in_flight = in_flight
            self._reply_ended_at = now
            if tool_calls:
                self._tool_pending = True
        finally:
            lock.release()
        return now if in_flight == 0 else None

    def paused_since(self) -> float | None:
        """When the pause in progress began (``None`` while a request is in flight or before
        the first reply)."""
        with self._lock:
            return None if self._in_flight else self._reply_ended_at

    def note_tool_started(self) -> None:
        """An adapter saw a tool start: this pause is a tool pause whatever the reply said."""
        with self._lock:
            self._tool_pending = True

    def current(self) -> Pause | None:
        """The pause in progress (nothing in flight, a reply has ended), without consuming it."""
        now = self._clock()
        with self._lock:
            if self._in_flight or self._reply_ended_at is None:
                return None
            ms = max(0, round((now - self._reply_ended_at) * 1000))
            return Pause(ms=ms, kind="tool" if self._tool_pending else "user")
