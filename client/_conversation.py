"""A conversation as the client sees it, and which one the running code is inside."""

from __future__ import annotations

import threading
import weakref
from asyncio import _get_running_loop
from collections import deque
from collections.abc import Coroutine
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from kvturn.headers import CONVERSATION_ID, PLAN, REUSED_TOKENS, PauseKind

from ._clock import Clock
from ._headers import HeaderItem, header_item
from ._pauses import Pause

if TYPE_CHECKING:
    from ._base import KvturnCore
    from ._heartbeats import ScheduledBeat

__all__ = ["Conversation", "Turn", "current_conversation", "finish_turn"]

#: How many past turns a conversation remembers for inspection; bounded so a long-lived
#: agent does not grow without end.
TURN_HISTORY = 64


_PLAN = PLAN.lower().encode("ascii")
_REUSED = REUSED_TOKENS.lower().encode("ascii")


def _answer_value(answer: list[HeaderItem] | None, lower_name: bytes) -> bytes | None:
    if answer:
        for _, key, value in answer:
            if key == lower_name:
                return value
    return None


async def _closed() -> None:
    """What a second ``aclose()`` of an already closed streamed reply awaits: nothing."""


class Turn:
    """One request of a conversation (all its SDK retries share the turn id) and its outcome.

    Made by the client, one per request; read them from ``Conversation.turns``.
    """

    # Slots, every one set when the turn is made (BaseKvturnClient._kvturn_begin fills them in
    # directly: no __init__ call on the per-request path). CPython 3.11 specialises a slot
    # read; it cannot specialise the read of a class-level default through an instance, which
    # then takes the generic look-up (and its type-cache luck) on every request.
    __slots__ = {
        "_response": (
            "The streamed reply's HTTP response until it closes (weakly: a response dropped "
            "unread ends the turn as it is collected)."
        ),
        "answer": (
            "The response headers of the turn's last attempt (httpx's raw triples), read on "
            "demand; None until one arrives."
        ),
        "conversation": "The conversation the turn belongs to.",
        "finished": "Whether the turn's reply has ended.",
        "header_items": (
            "The headers every attempt of this turn carries, in httpx's raw form (made once "
            "per turn, appended as they are to each attempt's request): the conversation id, "
            "the turn id, and after a pause its length and kind. The turn id and pause are "
            "read from them."
        ),
        "replace_headers": (
            "Whether the request must drop same-named headers before adding these (the caller "
            "or the client's default headers set one of them)."
        ),
        "tool_calls": "Whether the reply asked for tool calls (known once finished).",
        "tools_seen": (
            "Whether the streamed reply has called tools so far (set as its events are decoded)."
        ),
    }

    conversation: Conversation
    header_items: tuple[HeaderItem, ...]
    replace_headers: bool
    answer: list[HeaderItem] | None
    finished: bool
    tool_calls: bool
    tools_seen: bool
    _response: weakref.ref[Any] | None

    @property
    def turn_id(self) -> str:
        """The turn id every attempt of this turn carries."""
        return self.header_items[1][2].decode("ascii")

    @property
    def conversation_id(self) -> str:
        """The id of the conversation the turn belongs to."""
        return self.conversation.id

    @property
    def pause(self) -> Pause | None:
        """The pause before this turn, as sent in the headers (``None`` on a first or parallel
        turn)."""
        items = self.header_items
        if len(items) < 4:
            return None
        kind: PauseKind = "tool" if items[3][2] == b"tool" else "user"
        return Pause(ms=int(items[2][2]), kind=kind)

    @property
    def plan(self) -> str | None:
        """What the gateway did (``X-Kvturn-Plan``), if it said."""
        value = _answer_value(self.answer, _PLAN)
        return None if value is None else value.decode("latin-1")

    @property
    def reused_tokens(self) -> int | None:
        """Prompt tokens served from kept KV (``X-Kvturn-Reused-Tokens``), if the gateway said."""
        value = _answer_value(self.answer, _REUSED)
        return int(value) if value is not None and value.isdigit() else None

    @property
    def headers(self) -> dict[str, str]:
        """The headers every attempt of this turn carries."""
        return {name.decode(): value.decode() for name, _, value in self.header_items}

    # -- the end of a streamed reply: these replace its HTTP response's close()/aclose() -------

    def _end_reply(self) -> None:
        """``response.close()`` of a streamed reply: close it, and the turn ends."""
        ref = self._response
        self._response = None
        response = None if ref is None else ref()
        try:
            if response is not None:
                # The hook ends the turn once: later calls (the SDK closes a finished stream
                # more than once) go straight to the response's own method.
                try:  # noqa: SIM105  (contextlib.suppress costs ten times more)
                    del response.close
                except AttributeError:  # removed by someone else
                    pass
                type(response).close(response)
        finally:
            finish_turn(self, self.tools_seen)

    def _aend_reply(self) -> Coroutine[Any, Any, None]:
        """``response.aclose()`` of a streamed reply: the turn ends, and the response's own
        ``aclose()`` is handed back for the caller to await (a plain function: an ``async``
        one would add a coroutine of its own to every streamed turn)."""
        ref = self._response
        self._response = None
        response = None if ref is None else ref()
        finish_turn(self, self.tools_seen)
        if response is None:  # called again through a reference kept to the hook
            return _closed()
        try:  # noqa: SIM105  (later calls: the response's own, as above)
            del response.aclose
        except AttributeError:
            pass
        return type(response).aclose(response)

    def _response_gone(self, ref: weakref.ref[Any]) -> None:
        # Collected without being closed (a stream dropped before it was iterated).
        if self._response is ref:
            self._response = None
            finish_turn(self, self.tools_seen)

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
        self, conversation_id: str, *, core: KvturnCore, clock: Clock, lease_seconds: float
    ) -> None:
        self.id = conversation_id
        # Its X-Conversation-Id header, made once (ids are validated ASCII).
        self._id_item = header_item(CONVERSATION_ID, conversation_id)
        self._core = core
        self.lease_seconds = lease_seconds
        # Where the lease header sat in the last response's headers, and its raw value: the
        # gateway answers alike each time, so reading it is a look at one place, no search.
        self._lease_at = 0
        self._lease_raw: bytes | None = None
        # Its heartbeat plan as last seen by the client (the schedule owns it): a pause that
        # begins while the plan's beat is due within the pause's first interval needs nothing.
        self._beat: ScheduledBeat | None = None
        worker = core.worker
        self._wake_each_pause = worker is not None and worker.wake_each_pause
        # The client whose scope opened it last: heartbeats go out through that client.
        self._owner: weakref.ref[Any] | None = None
        # The pause clock, under the lock (sync clients may share a conversation between
        # threads, and streams end on whichever thread closes them). The client starts turns
        # on it (BaseKvturnClient._kvturn_begin), finish_turn() ends them. Nothing the garbage
        # collector tracks is made while it is held: a collection could run a weakref callback
        # that ends a turn (Turn._response_gone), which takes this lock.
        self._lock = threading.Lock()
        self._clock = clock
        self._in_flight = 0
        # None until the first reply ends, and again once a request has consumed the pause.
        self._reply_ended_at: float | None = None
        self._tool_pending = False
        self._turns_begun = 0
        # Appended to without a lock (one atomic deque operation); read through copy(), which
        # is atomic too.
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
        self._first_beat_after = seconds / 2 if seconds / 2 > floor else floor

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
        with self._lock:  # (nothing the garbage collector tracks is made under the lock)
            if self._in_flight or self._reply_ended_at is None:
                return None
            ended_at, tool = self._reply_ended_at, self._tool_pending
        return Pause(ms=max(0, round((now - ended_at) * 1000)), kind="tool" if tool else "user")

    def _paused_since(self) -> float | None:
        """When the pause in progress began (``None`` while a request is in flight)."""
        with self._lock:
            return None if self._in_flight else self._reply_ended_at

    def tool_started(self) -> None:
        """Report that a tool started: the pause it causes is a ``tool`` pause.

        Adapters call this from framework hooks; the reply's finish reason alone misses tool
        calls on APIs that report them another way.
        """
        with self._lock:
            self._tools_running += 1
            self._tool_pending = True

    def tool_finished(self) -> None:
        """Report that a tool finished (the pause goes on until the next request)."""
        with self._lock:
            self._tools_running = max(0, self._tools_running - 1)


def finish_turn(turn: Turn, tool_calls: bool) -> None:
    """The reply of ``turn`` ended (returned, stream exhausted or closed, or failed): the
    conversation is paused from now if nothing else of it is in flight."""
    if turn.finished:
        return
    conversation = turn.conversation
    paused_at = conversation._clock()
    lock = conversation._lock
    lock.acquire()  # explicit acquire/release: a ``with`` costs more than what it guards
    try:
        if turn.finished:  # ended meanwhile on another thread (a stream closed while read)
            return
        turn.finished = True
        turn.tool_calls = tool_calls
        in_flight = conversation._in_flight - 1
        if in_flight < 0:
            in_flight = 0
        conversation._in_flight = in_flight
        conversation._reply_ended_at = paused_at
        if tool_calls:
            conversation._tool_pending = True
    finally:
        lock.release()
    if in_flight:
        return
    # Nothing of the conversation is in flight any more: its beats must be planned. In steady
    # state (replies seconds apart, a lease of tens of seconds) its plan's next beat already
    # comes within this pause's first interval, and the schedule re-plans it from this pause
    # when it comes due: nothing to do here.
    beat = conversation._beat
    if beat is not None and paused_at < beat.next_at <= paused_at + conversation._first_beat_after:
        if conversation._wake_each_pause:
            # An async worker runs on one loop; only if that is not this one (the client moved
            # to another loop, or the worker has yet to run) must it hear of this.
            worker: Any = conversation._core.worker
            if worker.live_loop is not _get_running_loop():
                worker.wake(beat.next_at)
        return
    core = conversation._core
    if not core.beating or conversation.released:
        return
    beat = conversation._beat = core.schedule.pause_began(
        conversation.id, paused_at, conversation._lease_seconds
    )
    if beat is not None and core.worker is not None:
        core.worker.wake(beat.next_at)


_current: ContextVar[Conversation | None] = ContextVar("kvturn_conversation", default=None)

#: The turn whose request is being sent, for the hooks deeper in the SDK's call (each attempt's
#: HTTP request and response).
sending_turn: ContextVar[Turn | None] = ContextVar("kvturn_sending_turn", default=None)


def current_conversation() -> Conversation | None:
    """The conversation the calling code runs in (set by ``client.conversation()``), if any."""
    return _current.get()
