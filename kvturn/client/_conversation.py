"""A conversation as the client sees it, its turns, and which one the running code is inside."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from kvturn.headers import (
    CONVERSATION_ID,
    HEARTBEATS,
    LEASE_SECONDS,
    PAUSE_KIND,
    PAUSE_MS,
    PLAN,
    REUSED_TOKENS,
    TURN_ID,
    conversation_id_header,
)

from ._clock import Clock
from ._headers import new_turn_id
from ._pauses import Pause

if TYPE_CHECKING:
    from ._heartbeats import HeartbeatSchedule, ScheduledBeat, Worker
    from ._settings import KvturnSettings


class Core(Protocol):
    """What a conversation asks of the client's core (``_base.KvturnCore``): named here, not
    imported, as the core is made of conversations."""

    settings: KvturnSettings
    schedule: HeartbeatSchedule
    worker: Worker | None
    beating: bool


__all__ = [
    "Conversation",
    "Turn",
    "begin_turn",
    "current_conversation",
    "finish_turn",
    "resume_turn",
]

#: How many past turns a conversation remembers for inspection; bounded so a long-lived
#: agent does not grow without end.
TURN_HISTORY = 64


class Turn:
    """One request of a conversation (all its SDK retries share the turn id) and its outcome.

    Made by the client, one per request; read them from ``Conversation.turns``.
    """

    __slots__ = ("answer", "conversation", "finished", "headers", "tool_calls", "turn_id")

    def __init__(self, conversation: Conversation, headers: dict[str, str]) -> None:
        #: The conversation the turn belongs to.
        self.conversation = conversation
        #: The headers every attempt of this turn carries (see ``turn_headers``).
        self.headers = headers
        #: The turn id every attempt of this turn carries.
        self.turn_id = headers[TURN_ID]
        #: The response headers of the turn's last attempt; ``None`` until one arrives.
        self.answer: Mapping[str, str] | None = None
        #: Whether the turn's reply has ended.
        self.finished = False
        #: Whether the reply asked for tool calls (known once finished).
        self.tool_calls = False

    @property
    def conversation_id(self) -> str:
        """The id of the conversation the turn belongs to."""
        return self.conversation.id

    @property
    def pause(self) -> Pause | None:
        """The pause before this turn, as sent (``None`` on a first or parallel turn)."""
        ms = self.headers.get(PAUSE_MS)
        if ms is None:
            return None
        return Pause(ms=int(ms), kind="tool" if self.headers[PAUSE_KIND] == "tool" else "user")

    @property
    def plan(self) -> str | None:
        """What the gateway did (``X-Kvturn-Plan``), if it said."""
        return None if self.answer is None else self.answer.get(PLAN)

    @property
    def reused_tokens(self) -> int | None:
        """Prompt tokens served from kept KV (``X-Kvturn-Reused-Tokens``), if the gateway said."""
        value = None if self.answer is None else self.answer.get(REUSED_TOKENS)
        return int(value) if value is not None and value.isdigit() else None

    def __repr__(self) -> str:
        return (
            f"Turn(conversation_id={self.conversation_id!r}, turn_id={self.turn_id!r}, "
            f"pause={self.pause!r}, plan={self.plan!r}, reused_tokens={self.reused_tokens!r}, "
            f"tool_calls={self.tool_calls!r})"
        )


class Conversation:
    """One agent conversation: its id, pause clock, lease length and recent turns.

    Obtained from ``client.conversation(...)``; requests made inside that scope belong to it.
    """

    def __init__(
        self, conversation_id: str, *, core: Core, clock: Clock, lease_seconds: float
    ) -> None:
        self.id = conversation_id
        #: The id as its requests' ``X-Conversation-Id`` carries it (percent-encoded where it
        #: cannot travel as itself: :func:`kvturn.headers.conversation_id_header`).
        self.header_id = conversation_id_header(conversation_id)
        self._core = core
        self.lease_seconds = lease_seconds
        # The lease header's last raw value: the gateway answers alike each time.
        self._lease_raw: str | None = None
        # Its heartbeat plan as last seen by the client (the schedule owns it): a pause that
        # begins while the plan's beat is due within the pause's first interval needs nothing.
        self._beat: ScheduledBeat | None = None
        # The client whose scope opened it last: heartbeats go out through that client.
        self._owner: weakref.ref[Any] | None = None
        # The pause clock, under the lock (sync clients may share a conversation between
        # threads, and replies end on whichever thread closes them). Nothing the garbage
        # collector tracks is made while it is held: a collection could run the finalizer of
        # an abandoned reply, which ends its turn and takes this lock.
        self._pause_lock = threading.Lock()
        self._clock = clock
        self._in_flight = 0
        # None until the first reply ends, and again once a request has consumed the pause.
        self._reply_ended_at: float | None = None
        self._tool_pending = False
        self._turns_begun = 0
        self._history: deque[Turn] = deque(maxlen=TURN_HISTORY)
        self._scopes = 0
        self._tools_running = 0
        #: True once the client has asked the gateway to release the conversation.
        self.released = False

    def __repr__(self) -> str:
        return f"<Conversation {self.id!r} turns={self.turn_count} in_flight={self.in_flight}>"

    @property
    def lease_seconds(self) -> float:
        """Seconds the gateway keeps the conversation's KV without a turn or heartbeat (its
        ``X-Kvturn-Lease-Seconds``, or the client's default until it has said)."""
        return self._lease_seconds

    @lease_seconds.setter
    def lease_seconds(self, seconds: float) -> None:
        self._lease_seconds = seconds
        # When the first beat of a pause is due: half the lease, one lost beat still leaves
        # time for the next (never more often than the client's floor).
        floor = self._core.settings.min_heartbeat_interval_seconds
        self._first_beat_after = max(seconds / 2, floor)

    @property
    def in_flight(self) -> int:
        """Requests started and not yet finished."""
        return self._in_flight

    @property
    def turn_count(self) -> int:
        """Requests (turns) started in this conversation so far."""
        return self._turns_begun

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The most recent turns, oldest first (at most 64)."""
        return tuple(self._history.copy())

    @property
    def last_turn(self) -> Turn | None:
        """The most recent turn, if any."""
        history = self._history.copy()
        return history[-1] if history else None

    @property
    def tools_running(self) -> int:
        """Tools an adapter reported started and not yet finished."""
        return self._tools_running

    def current_pause(self) -> Pause | None:
        """The pause in progress, or ``None`` while a request is in flight (or before the
        first reply)."""
        now = self._clock()
        with self._pause_lock:
            if self._in_flight or self._reply_ended_at is None:
                return None
            ended_at, tool = self._reply_ended_at, self._tool_pending
        return _pause(now, ended_at, tool)

    def _paused_since(self) -> float | None:
        """When the pause in progress began (``None`` while a request is in flight)."""
        with self._pause_lock:
            return None if self._in_flight else self._reply_ended_at

    def observe_lease(self, answer: Mapping[str, str]) -> None:
        """Take the lease length the gateway states in a response's headers."""
        value = answer.get(LEASE_SECONDS)
        if value is None or value == self._lease_raw:
            return
        self._lease_raw = value
        try:
            seconds = float(value)
        except ValueError:
            return
        if seconds > 0:
            self.lease_seconds = seconds
            self._beat = None  # plan the next pause's beats for the new lease

    def tool_started(self) -> None:
        """Report that a tool started: the pause it causes is a ``tool`` pause.

        Adapters call this from framework hooks; the reply's finish reason alone misses tool
        calls on APIs that report them another way.
        """
        with self._pause_lock:
            self._tools_running += 1
            self._tool_pending = True

    def tool_finished(self) -> None:
        """Report that a tool finished (the pause goes on until the next request)."""
        with self._pause_lock:
            self._tools_running = max(0, self._tools_running - 1)


def _pause(now: float, ended_at: float, tool: bool) -> Pause:
    return Pause(ms=_pause_ms(now, ended_at), kind="tool" if tool else "user")


def _pause_ms(now: float, ended_at: float) -> int:
    ms = round((now - ended_at) * 1000)
    return ms if ms > 0 else 0


def begin_turn(conversation: Conversation) -> Turn:
    """A request of ``conversation`` starts: it consumes the pause before it, so that a second
    request started before any reply ends is parallel to this one, not paused. (The pause's
    beats stop by themselves: a due beat finds a request in flight and drops its plan.)"""
    now = conversation._clock()
    with conversation._pause_lock:
        ended_at, tool = conversation._reply_ended_at, conversation._tool_pending
        conversation._reply_ended_at = None
        conversation._tool_pending = False
        conversation._in_flight += 1
        conversation._turns_begun += 1
    # turn_headers(), made directly: this runs on every request.
    headers = {CONVERSATION_ID: conversation.header_id, TURN_ID: new_turn_id()}
    if conversation._core.beating:
        # The pause after this turn gets beats: the gateway may lease it for one beat's span.
        headers[HEARTBEATS] = "on"
    if ended_at is not None:
        headers[PAUSE_MS] = str(_pause_ms(now, ended_at))
        headers[PAUSE_KIND] = "tool" if tool else "user"
    turn = Turn(conversation, headers)
    conversation._history.append(turn)
    return turn


def resume_turn(turn: Turn) -> None:
    """Another attempt of a turn whose last attempt ended (the SDK retries it, or the HTTP
    client follows a redirect): it is in flight again, and the time between attempts is no
    pause."""
    conversation = turn.conversation
    with conversation._pause_lock:
        if not turn.finished:
            return
        turn.finished = False
        conversation._in_flight += 1
        conversation._reply_ended_at = None


def finish_turn(turn: Turn, tool_calls: bool) -> None:
    """The reply of ``turn`` ended (read, stream exhausted or closed, failed, or collected):
    the conversation is paused from now if nothing else of it is in flight."""
    conversation = turn.conversation
    paused_at = conversation._clock()
    with conversation._pause_lock:
        if turn.finished:  # (ended meanwhile on another thread, or a second close)
            return
        turn.finished = True
        turn.tool_calls = tool_calls
        in_flight = conversation._in_flight = max(0, conversation._in_flight - 1)
        conversation._reply_ended_at = paused_at
        if tool_calls:
            conversation._tool_pending = True
    if not in_flight:
        _plan_beats(conversation, paused_at)


def _plan_beats(conversation: Conversation, paused_at: float) -> None:
    # Nothing of the conversation is in flight any more: its beats must be planned. In steady
    # state (replies seconds apart, a lease of tens of seconds) its plan's next beat already
    # comes within this pause's first interval, and the schedule re-plans it from this pause
    # when it comes due: nothing to do here, unless an async worker must be told (its loop may
    # have ended: the client moved to another one).
    core = conversation._core
    beat = conversation._beat
    if beat is not None and paused_at < beat.next_at <= paused_at + conversation._first_beat_after:
        worker = core.worker
        if worker is not None and worker.wake_each_pause:
            worker.wake(beat.next_at)
        return
    if not core.beating or conversation.released:
        return
    beat = conversation._beat = core.schedule.pause_began(
        conversation.id, paused_at, conversation.lease_seconds
    )
    if beat is not None and core.worker is not None:
        core.worker.wake(beat.next_at)


_current: ContextVar[Conversation | None] = ContextVar("kvturn_conversation", default=None)


def current_conversation() -> Conversation | None:
    """The conversation the calling code runs in (set by ``client.conversation()``), if any."""
    return _current.get()
