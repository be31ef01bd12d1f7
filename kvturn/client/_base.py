"""Everything the sync and async kvturn clients share.

:class:`KvturnCore` is the state a client and its ``copy()``/``with_options()`` copies share:
settings, clock, open conversations, the heartbeat schedule and its worker. A turn is followed
at the HTTP client, by the event hooks of ``_hooks.py``. :class:`BaseKvturnClient` holds what
the two client classes share; ``OpenAI``/``AsyncOpenAI`` add only what differs by I/O.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

import openai
from pydantic import ValidationError

from kvturn.control import HeartbeatRequest, HeartbeatResponse
from kvturn.headers import conversation_id_problem

from ._clock import Clock, monotonic_clock
from ._conversation import Conversation, _current
from ._headers import new_conversation_id
from ._heartbeats import HeartbeatSchedule, ScheduledBeat, Worker
from ._hooks import install_hooks, live_cores
from ._settings import DEFAULT_LEASE_SECONDS, DEFAULT_MAX_PAUSE_SECONDS, KvturnSettings

if TYPE_CHECKING:
    from openai import RequestOptions

__all__ = [
    "REFUSAL_STATUSES",
    "BaseKvturnClient",
    "ControlCall",
    "KvturnCore",
]

log = logging.getLogger("kvturn.client")

#: Answers meaning "this server has no kvturn control API" (a plain OpenAI-compatible server):
#: after the first one the client stops sending heartbeats and releases altogether.
REFUSAL_STATUSES = frozenset({404, 405, 410, 501})

#: Conversations left without release are kept (their pause clock runs on for the next scope)
#: up to this many; the oldest idle ones are forgotten beyond it.
MAX_IDLE_CONVERSATIONS = 10_000


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
        live_cores.add(self)

    # -- conversation scopes ------------------------------------------------------------

    def enter(self, conversation_id: str | None, owner: object) -> Conversation:
        """Open (or re-open) a conversation scope."""
        if conversation_id is None:
            conversation_id = new_conversation_id()
        elif (problem := conversation_id_problem(conversation_id)) is not None:
            raise ValueError(
                f"invalid conversation id {conversation_id!r}: {problem} "
                "(kvturn.client.conversation_id_from() maps any string)"
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
        return self.forget(conversation.id) is not None and self.worth_releasing(conversation)

    def forget(self, conversation_id: str) -> Conversation | None:
        """Drop a conversation (released): no more beats, no more state."""
        with self._lock:
            self.schedule.stop(conversation_id)
            conversation = self.conversations.pop(conversation_id, None)
            if conversation is not None:
                conversation.released = True
            return conversation

    def worth_releasing(self, conversation: Conversation | None) -> bool:
        """Whether the gateway may hold something to release for it: a conversation that never
        sent a turn holds nothing there, and a server without the control API holds nothing."""
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

    def heartbeat_plan(
        self, entry: ScheduledBeat, client_class: type
    ) -> tuple[Any, Conversation, HeartbeatRequest] | None:
        """For a due beat: the client to send it through (of ``client_class``), the
        conversation and the body; ``None`` if the pause is over, beats are off, or the client
        that opened the conversation is gone."""
        conversation = self.conversations.get(entry.conversation_id)
        if conversation is None or conversation.released or not self.control_available:
            return None
        pause = conversation.current_pause()
        owner = conversation._owner() if conversation._owner is not None else None
        if pause is None or not isinstance(owner, client_class):
            return None
        return owner, conversation, HeartbeatRequest(pause_kind=pause.kind, paused_ms=pause.ms)

    def heartbeat_answered(self, entry: ScheduledBeat, body: str) -> float | None:
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


# -- the HTTP client's event hooks ---------------------------------------------------------

# -- the clients ---------------------------------------------------------------------------

#: The core a client being made by ``copy()`` shares with the client copied.
_copying: ContextVar[KvturnCore | None] = ContextVar("kvturn_copying", default=None)


class BaseKvturnClient:
    """What ``OpenAI`` and ``AsyncOpenAI`` share (mixed in before the SDK's classes)."""

    _kvturn: KvturnCore
    #: Whether the client is the async one (its hooks and worker are).
    _kvturn_asynchronous: ClassVar[bool] = False

    def __init__(
        self,
        *,
        default_lease_seconds: float = DEFAULT_LEASE_SECONDS,
        max_pause_seconds: float = DEFAULT_MAX_PAUSE_SECONDS,
        heartbeats: bool = True,
        release_on_exit: bool = True,
        control_timeout_seconds: float = 5.0,
        kvturn_settings: KvturnSettings | None = None,
        clock: Clock | None = None,
        **kwargs: Any,
    ) -> None:
        http_client = kwargs.get("http_client")
        if http_client is None:
            # The HTTP client the SDK would make, with its defaults; made here to hook it.
            http_client = kwargs["http_client"] = self._kvturn_default_http_client()
        install_hooks(http_client, asynchronous=self._kvturn_asynchronous)
        super().__init__(**kwargs)
        core = _copying.get()
        if core is None:
            settings = kvturn_settings or KvturnSettings(
                default_lease_seconds=default_lease_seconds,
                max_pause_seconds=max_pause_seconds,
                heartbeats=heartbeats,
                release_on_exit=release_on_exit,
                control_timeout_seconds=control_timeout_seconds,
            )
            core = KvturnCore(settings, clock or monotonic_clock)
            core.worker = self._kvturn_worker(core)
        self._kvturn = core

    @classmethod
    def _kvturn_default_http_client(cls) -> Any:
        raise NotImplementedError

    @classmethod
    def _kvturn_worker(cls, core: KvturnCore) -> Worker:
        raise NotImplementedError

    @property
    def kvturn_settings(self) -> KvturnSettings:
        """The kvturn options this client (and its copies) run with."""
        return self._kvturn.settings

    @property
    def kvturn_conversations(self) -> Mapping[str, Conversation]:
        """Conversations open or kept (left without release), by id. Read-only view."""
        return self._kvturn.conversations

    def copy(self, **kwargs: Any) -> Self:
        """The SDK's ``copy()``; the copy shares the kvturn options, conversations and worker."""
        token = _copying.set(self._kvturn)
        try:
            return super().copy(**kwargs)  # type: ignore[misc, no-any-return]
        finally:
            _copying.reset(token)

    with_options = copy

    def _kvturn_forget_for_release(self, conversation_id: str) -> bool:
        # An open conversation is ended here: True when the gateway should be told.
        core = self._kvturn
        return core.worth_releasing(core.forget(conversation_id))


class ControlCall:
    """One heartbeat or release call: sent outside any conversation (it is no turn), with no
    SDK retries (the next beat is the retry) and a short timeout; its failure is logged and
    remembered, never raised::

        with ControlCall(core, "heartbeat", conversation_id) as call:
            call.answer = client.post(path, cast_to=str, body=..., options=call.options)
        return call.next_beat(entry)
    """

    def __init__(self, core: KvturnCore, what: str, conversation_id: str) -> None:
        self._core = core
        self._what = what
        self._conversation_id = conversation_id
        self.options: RequestOptions = {
            "max_retries": 0,
            "timeout": core.settings.control_timeout_seconds,
        }
        #: The answer's body (set by the caller).
        self.answer: str | None = None
        self.refused = False
        self.failed = False
        self._token: Token[Conversation | None] | None = None

    def __enter__(self) -> Self:
        self._token = _current.set(None)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._token is not None:
            _current.reset(self._token)
        if exc is None or not isinstance(exc, Exception):
            return False
        self.failed = True
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        if status is None:
            log.debug("kvturn: %s error: %r", self._what, exc)
        self.refused = self._core.control_failed(self._what, self._conversation_id, status)
        return True

    def next_beat(self, entry: ScheduledBeat) -> float | None:
        """After a heartbeat: when the next is due, or ``None`` to stop."""
        if self.refused:
            return None
        if self.failed or self.answer is None:
            return entry.interval
        return self._core.heartbeat_answered(entry, self.answer)
