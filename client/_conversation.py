"""A conversation as the client sees it, and which one the running code is inside."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._clock import Clock
from ._pauses import Pause, PauseTracker

if TYPE_CHECKING:
    from ._base import KvturnCore

__all__ = ["Conversation", "Turn", "current_conversation"]

#: How many past turns a conversation remembers for inspection; bounded so a long-lived
#: agent does not grow without end.
TURN_HISTORY = 64


@dataclass(slots=True, eq=False)
class Turn:
    """One request of a conversation (all its SDK retries share the turn id) and its outcome."""

    conversation_id: str
    turn_id: str
    #: The pause before this turn, as sent in the headers (``None`` on a first/parallel turn).
    pause: Pause | None
    conversation: Conversation = field(repr=False, compare=False)
    #: What the gateway did (``X-Kvturn-Plan``), if it said.
    plan: str | None = None
    #: Prompt tokens served from kept KV (``X-Kvturn-Reused-Tokens``), if the gateway said.
    reused_tokens: int | None = None
    #: Whether the reply asked for tool calls (known once finished).
    tool_calls: bool = False
    #: The headers every attempt of this turn carries.
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    finished: bool = field(default=False, repr=False)


class Conversation:
    """One agent conversation: its id, pause clock, lease length and recent turns.

    Obtained from ``client.conversation(...)``; requests made inside that scope belong to it.
    """

    def __init__(
        self, conversation_id: str, *, core: KvturnCore, clock: Clock, lease_seconds: float
    ) -> None:
        self.id = conversation_id
        #: Seconds the gateway keeps the conversation's KV without a turn or heartbeat (its
        #: ``X-Kvturn-Lease-Seconds``, or the client's default until it has said).
        self.lease_seconds = lease_seconds
        self._core = core
        # The client whose scope opened it last: heartbeats go out through that client.
        self._owner: weakref.ref[Any] | None = None
        self._pauses = PauseTracker(clock)
        self._history: deque[Turn] = deque(maxlen=TURN_HISTORY)
        self._lock = threading.Lock()
        self._scopes = 0
        self._tools_running = 0
        self.turn_count = 0
        #: True once the client has asked the gateway to release the conversation.
        self.released = False

    def __repr__(self) -> str:
        return f"<Conversation {self.id!r} turns={self.turn_count} in_flight={self.in_flight}>"

    @property
    def in_flight(self) -> int:
        """Requests started and not yet finished."""
        return self._pauses.in_flight

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The most recent turns, oldest first (at most 64)."""
        with self._lock:
            return tuple(self._history)

    @property
    def last_turn(self) -> Turn | None:
        """The most recent turn, if any."""
        with self._lock:
            return self._history[-1] if self._history else None

    @property
    def tools_running(self) -> int:
        """Tools an adapter reported started and not yet finished."""
        return self._tools_running

    def current_pause(self) -> Pause | None:
        """The pause in progress, or ``None`` while a request is in flight."""
        return self._pauses.current()

    def tool_started(self) -> None:
        """Report that a tool started: the pause it causes is a ``tool`` pause.

        Adapters call this from framework hooks; the reply's finish reason alone misses tool
        calls on APIs that report them another way.
        """
        with self._lock:
            self._tools_running += 1
        self._pauses.note_tool_started()

    def tool_finished(self) -> None:
        """Report that a tool finished (the pause goes on until the next request)."""
        with self._lock:
            self._tools_running = max(0, self._tools_running - 1)

    # The client drives the rest; these are not for agent code.

    def _record(self, turn: Turn) -> None:
        with self._lock:
            self.turn_count += 1
            self._history.append(turn)


_current: ContextVar[Conversation | None] = ContextVar("kvturn_conversation", default=None)


def current_conversation() -> Conversation | None:
    """The conversation the calling code runs in (set by ``client.conversation()``), if any."""
    return _current.get()
