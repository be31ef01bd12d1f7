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
from contextvars import ContextVar
from typing import Any, Protocol

from openai import APIResponse, AsyncAPIResponse
from openai._legacy_response import LegacyAPIResponse
from openai._models import FinalRequestOptions
from openai._utils import is_given
from pydantic import ValidationError

from kvturn.control import CONVERSATIONS_PATH, HeartbeatRequest, HeartbeatResponse
from kvturn.headers import (
    CONVERSATION_ID,
    LEASE_SECONDS,
    PAUSE_KIND,
    PAUSE_MS,
    PLAN,
    REUSED_TOKENS,
    TURN_ID,
    is_valid_conversation_id,
)

from ._clock import Clock
from ._conversation import Conversation, Turn, _current
from ._headers import new_conversation_id, new_turn_id, turn_headers
from ._heartbeats import HeartbeatSchedule, ScheduledBeat
from ._replies import asks_for_tools
from ._settings import KvturnSettings

__all__ = ["REFUSAL_STATUSES", "BaseKvturnClient", "KvturnCore"]

log = logging.getLogger("kvturn.client")

#: Answers meaning "this server has no kvturn control API" (a plain OpenAI-compatible server):
#: after the first one the client stops sending heartbeats and releases altogether.
REFUSAL_STATUSES = frozenset({404, 405, 410, 501})

#: Conversations left without release are kept (their pause clock runs on for the next scope)
#: up to this many; the oldest idle ones are forgotten beyond it.
MAX_IDLE_CONVERSATIONS = 10_000

_LEASE = LEASE_SECONDS.lower().encode()
_PLAN = PLAN.lower().encode()
_REUSED = REUSED_TOKENS.lower().encode()

#: The turn whose request is being sent, for the hooks deeper in the SDK's call (response
#: headers, stream construction): a context lookup instead of re-reading request headers.
sending_turn: ContextVar[Turn | None] = ContextVar("kvturn_sending_turn", default=None)


_CONVERSATION_ID_LOWER = CONVERSATION_ID.lower()
_TURN_HEADER_KEYS = frozenset(
    name.lower().encode("ascii") for name in (CONVERSATION_ID, TURN_ID, PAUSE_MS, PAUSE_KIND)
)


def _set_headers(headers: Any, values: dict[str, str]) -> None:
    """``headers[k] = v`` for each of ``values`` (turn header names only), replacing any
    same-named header."""
    raw = getattr(headers, "_list", None)
    if type(raw) is list:
        # httpx/httpx2 keep (raw key, lower key, value) byte triples; each public
        # __setitem__ rescans and re-decodes them all (~3 us a header, a third of kvturn's
        # per-request cost). Same result: drop same-named entries, append ours.
        if any(item[1] in _TURN_HEADER_KEYS for item in raw):
            raw[:] = [item for item in raw if item[1] not in _TURN_HEADER_KEYS]
        raw.extend(
            (key.encode("ascii"), key.lower().encode("ascii"), value.encode("ascii"))
            for key, value in values.items()
        )
        return
    for key, value in values.items():
        headers[key] = value


class Worker(Protocol):
    """The heartbeat worker: a thread (sync) or a task (async)."""

    def wake(self, deadline: float | None = None) -> None: ...


class KvturnCore:
    """State shared by a kvturn client and its copies."""

    def __init__(self, settings: KvturnSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.schedule = HeartbeatSchedule(settings)
        self.worker: Worker | None = None
        self.conversations: dict[str, Conversation] = {}
        #: Turns whose reply has not ended, by turn id: streams find theirs here.
        self.open_turns: dict[str, Turn] = {}
        #: False once the server refused a control call: it is not a kvturn gateway.
        self.control_available = True
        self.closed = False
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

    def pause_started(self, conversation: Conversation, paused_at: float) -> None:
        """Nothing of ``conversation`` is in flight any more: plan its beats."""
        if not (self.settings.heartbeats and self.control_available) or self.closed:
            return
        if conversation.released:
            return
        first_beat = self.schedule.start(
            conversation.id, paused_at=paused_at, lease_seconds=conversation.lease_seconds
        )
        if first_beat is not None and self.worker is not None:
            self.worker.wake(first_beat)

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
        self.schedule.clear()


class BaseKvturnClient:
    """Turn bookkeeping shared by ``OpenAI`` and ``AsyncOpenAI`` (mixed in before them)."""

    _kvturn: KvturnCore

    @property
    def kvturn_settings(self) -> KvturnSettings:
        """The kvturn options this client (and its copies) run with."""
        return self._kvturn.settings

    @property
    def kvturn_conversations(self) -> Mapping[str, Conversation]:
        """Conversations open or kept (left without release), by id. Read-only view."""
        return self._kvturn.conversations

    def _kvturn_conversation_for(self, options: FinalRequestOptions) -> Conversation | None:
        if options.url.startswith(CONVERSATIONS_PATH):
            return None  # control calls are not turns
        conversation = _current.get()
        if conversation is not None:
            return conversation
        # Code that cannot carry a context (a thread pool without copy_context) can still name
        # an open conversation with the header itself.
        if is_given(options.headers):
            for key, value in options.headers.items():
                if key.lower() == _CONVERSATION_ID_LOWER and isinstance(value, str):
                    return self._kvturn.conversations.get(value)
        return None

    def _kvturn_begin(self, options: FinalRequestOptions) -> Turn | None:
        """Start a turn for a request made inside a conversation (``None`` outside one).

        Called once per logical request, before the SDK's retry loop; every attempt then gets
        this turn's headers (see ``_kvturn_tag``), so all retries share the turn id.
        """
        conversation = self._kvturn_conversation_for(options)
        if conversation is None:
            return None
        # Beats of the pause that ends here stop by themselves: a due beat finds a request in
        # flight and drops its plan, and the next pause replaces it. Not touching the schedule
        # here keeps the heartbeat worker asleep in steady state.
        pause = conversation._pauses.begin_request()
        turn_id = new_turn_id()
        turn = Turn(
            conversation.id,
            turn_id,
            pause,
            conversation,
            headers=turn_headers(conversation.id, turn_id, pause),
        )
        conversation._record(turn)
        self._kvturn.open_turns[turn_id] = turn
        return turn

    @staticmethod
    def _kvturn_tag(request: Any) -> None:
        """Add the sending turn's headers to one attempt's HTTP request.

        Done on the built ``httpx2.Request`` (the SDK's ``_prepare_request`` hook) rather than
        through the request options: the options path costs the SDK about twice as much per
        header (merging, validation, re-normalising) and needs a copy of the options.
        """
        turn = sending_turn.get()
        if turn is not None:
            _set_headers(request.headers, turn.headers)

    def _kvturn_open_turn(self, turn_id: str | None) -> Turn | None:
        turn = sending_turn.get()
        if turn is not None:
            return turn
        # A stream parsed after its request returned (with_raw_response): find it by its id.
        return None if turn_id is None else self._kvturn.open_turns.get(turn_id)

    def _kvturn_finish(self, turn: Turn, *, tool_calls: bool) -> None:
        """The reply of ``turn`` ended (returned, stream exhausted or closed, or failed)."""
        if turn.finished:
            return
        turn.finished = True
        turn.tool_calls = tool_calls
        self._kvturn.open_turns.pop(turn.turn_id, None)
        conversation = turn.conversation
        paused_at = conversation._pauses.end_reply(tool_calls=tool_calls)
        if paused_at is not None:
            conversation._core.pause_started(conversation, paused_at)

    def _kvturn_observe(self, turn: Turn, headers: Any) -> None:
        """Read what the gateway says about ``turn`` from an attempt's response headers."""
        # One pass over the raw list: three Headers.get() calls would cost ~10x more.
        for key, value in headers.raw:
            key = key.lower()
            if not key.startswith(b"x-kvturn-"):
                continue
            if key == _LEASE:
                try:
                    seconds = float(value)
                except ValueError:
                    continue
                if seconds > 0:
                    turn.conversation.lease_seconds = seconds
            elif key == _PLAN:
                turn.plan = value.decode("latin-1")
            elif key == _REUSED and value.isdigit():
                turn.reused_tokens = int(value)

    @staticmethod
    def _kvturn_result_asks_for_tools(result: object) -> bool:
        if isinstance(result, LegacyAPIResponse):
            # with_raw_response (LangChain's path): the body is already read and parse() caches,
            # so the caller's own parse() costs nothing extra.
            try:
                return asks_for_tools(result.parse())
            except Exception:
                return False
        if isinstance(result, (APIResponse, AsyncAPIResponse)):
            return False  # with_streaming_response: the body is not read yet
        return asks_for_tools(result)
