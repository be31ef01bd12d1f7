"""Everything the sync and async kvturn clients share that does no I/O.

:class:`KvturnCore` is the state a client and its ``copy()``/``with_options()`` copies share:
settings, clock, open conversations, the heartbeat schedule and its worker.
:class:`BaseKvturnClient` turns requests into turns (headers, pause clock, stream swap) and
interprets control-API answers; ``OpenAI``/``AsyncOpenAI`` add only the sending.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Protocol

from openai._models import FinalRequestOptions
from openai._types import NotGiven
from openai._utils import is_given
from pydantic import ValidationError

from kvturn.control import HeartbeatRequest, HeartbeatResponse
from kvturn.headers import (
    CONVERSATION_ID,
    LEASE_SECONDS,
    is_valid_conversation_id,
)

from ._clock import Clock
from ._conversation import Conversation, Turn, _current, finish_turn, sending_turn
from ._headers import (
    PAUSE_KIND_ITEMS,
    PAUSE_MS_KEY,
    PAUSE_MS_LOWER,
    TURN_HEADER_KEYS,
    HeaderItem,
    new_conversation_id,
    refill_turn_ids,
    turn_id_pool,
)
from ._heartbeats import HeartbeatSchedule, ScheduledBeat
from ._settings import KvturnSettings
from ._streams import SDK_DECODER_IS_PLAIN, WatchingDecoder, WatchingWrapper

__all__ = [
    "REFUSAL_STATUSES",
    "BaseKvturnClient",
    "KvturnCore",
    "names_turn_headers",
    "observe_response_headers",
    "sending_turn",
    "tag_request_headers",
]

log = logging.getLogger("kvturn.client")

#: Answers meaning "this server has no kvturn control API" (a plain OpenAI-compatible server):
#: after the first one the client stops sending heartbeats and releases altogether.
REFUSAL_STATUSES = frozenset({404, 405, 410, 501})

#: Conversations left without release are kept (their pause clock runs on for the next scope)
#: up to this many; the oldest idle ones are forgotten beyond it.
MAX_IDLE_CONVERSATIONS = 10_000

LEASE_KEY = LEASE_SECONDS.lower().encode()

# Turns are made without a call to Turn.__init__ (see _kvturn_begin).
_new_turn = object.__new__
_TOOL_PAUSE_ITEM = PAUSE_KIND_ITEMS["tool"]
_USER_PAUSE_ITEM = PAUSE_KIND_ITEMS["user"]

_CONVERSATION_ID_LOWER = CONVERSATION_ID.lower()
_lower_key = itemgetter(1)


def tag_request_headers(headers: Any, items: tuple[HeaderItem, ...], replace: bool = True) -> None:
    """Put a turn's headers (raw ``items``) on a request's ``headers``; with ``replace``, any
    same-named ones go first (without, the caller knows there are none)."""
    raw = getattr(headers, "_list", None)
    if type(raw) is list:
        # httpx/httpx2 keep (raw key, lower key, value) byte triples; each public
        # __setitem__ rescans and re-encodes them all. Same result for a fraction of the cost:
        # drop same-named entries, append ours as they are.
        if replace and not TURN_HEADER_KEYS.isdisjoint(map(_lower_key, raw)):
            raw[:] = [item for item in raw if item[1] not in TURN_HEADER_KEYS]
        if headers._encoding is None:
            # Worked out once, over every header, on first use (ASCII unless some value is
            # not); ours are ASCII, so working it out before adding them gives the same answer
            # without decoding them too.
            headers.encoding  # noqa: B018
        raw.extend(items)
        return
    for name, _, value in items:
        headers[name.decode("ascii")] = value.decode("ascii")


def names_turn_headers(headers: Any) -> bool:
    """Whether a mapping of header names holds any of the turn headers (any case)."""
    return any(
        isinstance(name, str) and name.lower().encode("ascii", "replace") in TURN_HEADER_KEYS
        for name in headers
    )


def observe_response_headers(turn: Turn, headers: Any) -> None:
    """Keep an attempt's response headers on ``turn`` (its plan and reused tokens are read from
    them on demand) and take the lease length the gateway states."""
    raw = getattr(headers, "_list", None)
    if type(raw) is not list:
        raw = [(key, key.lower(), value) for key, value in headers.raw]
    turn.answer = raw
    conversation = turn.conversation
    at = conversation._lease_at
    if at < len(raw) and raw[at][1] == LEASE_KEY:
        value = raw[at][2]
    else:  # first answer, or the headers moved: search them
        for at, (_, key, value) in enumerate(raw):  # noqa: B007
            if key == LEASE_KEY:
                conversation._lease_at = at
                break
        else:
            return
    if value == conversation._lease_raw:
        return
    try:
        seconds = float(value)
    except ValueError:
        return
    conversation._lease_raw = value
    if seconds > 0:
        conversation.lease_seconds = seconds
        conversation._beat = None  # plan the next pause's beats for the new lease


class Worker(Protocol):
    """The heartbeat worker: a thread (sync) or a task (async)."""

    #: Whether it must hear of every pause, even one its plan already covers (a task must
    #: check that it still runs on the caller's loop).
    wake_each_pause: bool

    def wake(self, deadline: float | None = None) -> None: ...


class KvturnCore:
    """State shared by a kvturn client and its copies."""

    def __init__(self, settings: KvturnSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.schedule = HeartbeatSchedule(settings, self._pause_of)
        self.worker: Worker | None = None
        self.conversations: dict[str, Conversation] = {}
        #: False once the server refused a control call: it is not a kvturn gateway.
        self.control_available = True
        self.closed = False
        #: Whether pauses get heartbeats: heartbeats on, control API there, client open.
        self.beating = settings.heartbeats
        self._lock = threading.Lock()

    # -- conversation scopes ------------------------------------------------------------

    def enter(self, conversation_id: str | None, owner: object) -> Conversation:
        """Open (or re-open) a conversation scope."""
        if conversation_id is None:
            conversation_id = new_conversation_id()
        elif not is_valid_conversation_id(conversation_id):
            raise ValueError(
                f"invalid conversation id {conversation_id!r}: use 1-128 characters of "
                "A-Z a-z 0-9 . _ : - (kvturn.client.conversation_id_from() maps any string)"
            )
        with self._lock:
            conversation = self.conversations.get(conversation_id)
            if conversation is None:
                conversation = Conversation(
                    conversation_id,
                    core=self,
                    clock=self.clock,
                    lease_seconds=self.settings.default_lease_seconds,
                )
                self.conversations[conversation_id] = conversation
            conversation._scopes += 1
            conversation._owner = weakref.ref(owner)
            conversation.released = False
        return conversation

    def leave(self, conversation: Conversation, *, release: bool) -> bool:
        """Close a scope; True when the caller should now tell the gateway to release.

        Without ``release`` the conversation goes on beyond the scope (the next user message
        will come in a new scope): it stays open, its pause clock runs and its beats continue
        up to the maximum pause, until a releasing scope or ``release_conversation``.
        """
        with self._lock:
            conversation._scopes = max(0, conversation._scopes - 1)
            if conversation._scopes or conversation.released:
                return False
            if not release:
                # Move it to the end so eviction takes the longest-idle first.
                self.conversations.pop(conversation.id, None)
                self.conversations[conversation.id] = conversation
                self._evict_idle()
                return False
        return self.forget(conversation.id) is not None and self._worth_releasing(conversation)

    def forget(self, conversation_id: str) -> Conversation | None:
        """Drop a conversation (released): no more beats, no more state."""
        with self._lock:
            self.schedule.stop(conversation_id)
            conversation = self.conversations.pop(conversation_id, None)
            if conversation is not None:
                conversation.released = True
            return conversation

    def _worth_releasing(self, conversation: Conversation | None) -> bool:
        # A conversation that never sent a turn holds nothing at the gateway.
        if not self.control_available:
            return False
        return conversation is None or conversation.turn_count > 0

    def _evict_idle(self) -> None:
        excess = len(self.conversations) - MAX_IDLE_CONVERSATIONS
        if excess <= 0:
            return
        for key in [k for k, c in self.conversations.items() if not c._scopes][:excess]:
            self.schedule.stop(key)
            del self.conversations[key]

    # -- pauses and heartbeats ------------------------------------------------------------

    def _pause_of(self, conversation_id: str) -> tuple[float, float] | None:
        conversation = self.conversations.get(conversation_id)
        if conversation is None:
            return None
        since = conversation._paused_since()
        return None if since is None else (since, conversation.lease_seconds)

    def heartbeat_body(self, entry: ScheduledBeat) -> tuple[Conversation, HeartbeatRequest] | None:
        """What to send for a due beat, or ``None`` if the pause is over or beats are off."""
        conversation = self.conversations.get(entry.conversation_id)
        if conversation is None or conversation.released or not self.control_available:
            return None
        pause = conversation.current_pause()
        if pause is None:
            return None
        return conversation, HeartbeatRequest(pause_kind=pause.kind, paused_ms=pause.ms)

    def heartbeat_answered(self, entry: ScheduledBeat, body: bytes) -> float | None:
        """Interpret a 2xx heartbeat answer; returns the next interval or ``None`` to stop."""
        try:
            answer = HeartbeatResponse.model_validate_json(body)
        except ValidationError:
            log.warning("kvturn: unreadable heartbeat answer for %s", entry.conversation_id)
            return entry.interval
        if not answer.known:
            # The gateway holds nothing for it (expired, or never served): nothing to renew.
            log.debug("kvturn: gateway does not know %s; beats stop", entry.conversation_id)
            return None
        if answer.next_heartbeat_s is not None and answer.next_heartbeat_s > 0:
            return answer.next_heartbeat_s
        if answer.lease_remaining_s > 0:
            return answer.lease_remaining_s / 2
        return entry.interval

    def control_failed(self, what: str, conversation_id: str, status: int | None) -> bool:
        """Log a failed control call; True when it was a refusal (control API absent)."""
        if status in REFUSAL_STATUSES:
            if self.control_available:
                log.info(
                    "kvturn: server answered %s to a %s: no kvturn control API there; "
                    "heartbeats and releases are off for this client",
                    status,
                    what,
                )
            self.control_available = False
            self.beating = False
            self.schedule.clear()
            return True
        log.warning(
            "kvturn: %s for conversation %s failed (%s)",
            what,
            conversation_id,
            status if status is not None else "no answer",
        )
        return False

    def close(self) -> None:
        """Stop planning beats; the owning client stops the worker."""
        self.closed = True
        self.beating = False
        self.schedule.clear()


class BaseKvturnClient:
    """Turn bookkeeping shared by ``OpenAI`` and ``AsyncOpenAI`` (mixed in before them)."""

    _kvturn: KvturnCore
    #: Whether the client's own default headers (SDK or HTTP client level) name a turn header.
    #: Set by ``__init__`` (no class-level default: reading one through an instance is not
    #: specialised by CPython 3.11).
    _kvturn_replace_headers: bool

    @property
    def kvturn_settings(self) -> KvturnSettings:
        """The kvturn options this client (and its copies) run with."""
        return self._kvturn.settings

    @property
    def kvturn_conversations(self) -> Mapping[str, Conversation]:
        """Conversations open or kept (left without release), by id. Read-only view."""
        return self._kvturn.conversations

    def _kvturn_named_conversation(self, options: FinalRequestOptions) -> Conversation | None:
        # Code that cannot carry a context (a thread pool without copy_context) can still name
        # an open conversation with the header itself.
        if is_given(options.headers):
            for key, value in options.headers.items():
                if key.lower() == _CONVERSATION_ID_LOWER and isinstance(value, str):
                    return self._kvturn.conversations.get(value)
        return None

    def _kvturn_begin(
        self, options: FinalRequestOptions, conversation: Conversation | None = None
    ) -> Turn | None:
        """Start a turn for a request made inside a conversation (``None`` outside one).

        Called once per logical request, before the SDK's retry loop; every attempt then gets
        this turn's headers (see ``_send_request``), so all retries share the turn id. Kept to
        few calls and few objects: it runs amid ~1 ms of SDK work, with cold caches, where
        each step costs several times what it does in a hot loop.
        """
        if conversation is None:
            conversation = _current.get()  # (the caller may have looked it up already)
        if conversation is None:
            conversation = self._kvturn_named_conversation(options)
            if conversation is None:
                return None
        # The pause that ends here: consumed, so that a second request started before any reply
        # ends is parallel to this one, not paused. (Its beats stop by themselves: a due beat
        # finds a request in flight and drops its plan.)
        now = conversation._clock()
        lock = conversation._lock
        lock.acquire()  # explicit acquire/release: a ``with`` costs more than what it guards
        try:
            ended_at = conversation._reply_ended_at
            tool = conversation._tool_pending
            conversation._reply_ended_at = None
            conversation._tool_pending = False
            conversation._in_flight += 1
            conversation._turns_begun += 1
        finally:
            lock.release()
        try:
            turn_id_item = turn_id_pool.pop()
        except IndexError:
            refill_turn_ids()
            turn_id_item = turn_id_pool.pop()
        turn = _new_turn(Turn)
        if ended_at is None:
            turn.header_items = (conversation._id_item, turn_id_item)
        else:
            ms = round((now - ended_at) * 1000)
            if ms < 0:
                ms = 0
            turn.header_items = (
                conversation._id_item,
                turn_id_item,
                (PAUSE_MS_KEY, PAUSE_MS_LOWER, b"%d" % ms),
                _TOOL_PAUSE_ITEM if tool else _USER_PAUSE_ITEM,
            )
        turn.conversation = conversation
        # Whether a header of ours may already be on the request (set by the caller, or among
        # the client's default headers): only then is each attempt's request searched for it.
        headers = options.headers
        turn.replace_headers = self._kvturn_replace_headers or (
            type(headers) is not NotGiven and names_turn_headers(headers)
        )
        turn.answer = None
        turn.finished = False
        turn.tool_calls = False
        turn.tools_seen = False
        turn._response = None
        conversation._history.append(turn)
        return turn

    def _kvturn_finish(self, turn: Turn, tool_calls: bool) -> None:
        """The reply of ``turn`` ended (returned, stream exhausted or closed, or failed)."""
        finish_turn(turn, tool_calls)

    def _make_sse_decoder(self) -> Any:
        # Called as the SDK builds a stream: one made while a turn is being sent decodes its
        # events watching for tool calls (see _streams.py).
        turn = sending_turn.get()
        if turn is None:
            return super()._make_sse_decoder()  # type: ignore[misc]
        if SDK_DECODER_IS_PLAIN:  # what the SDK's would be, plus the watch
            decoder = WatchingDecoder()
            decoder._kvturn_turn = turn
            return decoder
        return WatchingWrapper(super()._make_sse_decoder(), turn)  # type: ignore[misc]
