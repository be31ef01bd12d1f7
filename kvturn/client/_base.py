"""Everything the sync and async kvturn clients share.

:class:`KvturnCore` is the state a client and its ``copy()``/``with_options()`` copies share:
settings, clock, open conversations, the heartbeat schedule and its worker.

A turn is followed at the HTTP client, through its public event hooks, so it sees exactly what
goes on the wire whatever the SDK does above it (retries, streams, raw responses):
:func:`attempt_started` (the request hook) starts the turn, or resumes it for a retry, and puts
its headers on the request; :func:`attempt_answered` (the response hook) reads the gateway's
answer headers, then reads a JSON body itself (the turn ends there) or puts a watcher on a
stream's bytes that ends the turn when the stream does (``_bodies.py``). Known limit: a request
that fails before any answer (a connection error the SDK gives up on) is seen by no hook; its
turn ends when the next request of the same context starts. :class:`BaseKvturnClient` holds
what the two client classes share; ``OpenAI``/``AsyncOpenAI`` add only what differs by I/O.
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
from kvturn.headers import (
    CONVERSATION_ID,
    PAUSE_KIND,
    PAUSE_MS,
    TURN_ID,
    conversation_id_from_header,
    conversation_id_problem,
)

from ._bodies import AsyncWatchedStream, WatchedStream, body_read
from ._clock import Clock, monotonic_clock
from ._conversation import Conversation, Turn, _current, begin_turn, finish_turn, resume_turn
from ._headers import new_conversation_id
from ._heartbeats import HeartbeatSchedule, ScheduledBeat, Worker
from ._settings import DEFAULT_LEASE_SECONDS, DEFAULT_MAX_PAUSE_SECONDS, KvturnSettings

if TYPE_CHECKING:
    from openai import RequestOptions

__all__ = [
    "REFUSAL_STATUSES",
    "BaseKvturnClient",
    "ControlCall",
    "KvturnCore",
    "attempt_answered",
    "attempt_started",
    "install_hooks",
]

log = logging.getLogger("kvturn.client")

#: Answers meaning "this server has no kvturn control API" (a plain OpenAI-compatible server):
#: after the first one the client stops sending heartbeats and releases altogether.
REFUSAL_STATUSES = frozenset({404, 405, 410, 501})

#: Conversations left without release are kept (their pause clock runs on for the next scope)
#: up to this many; the oldest idle ones are forgotten beyond it.
MAX_IDLE_CONVERSATIONS = 10_000

#: The header the openai SDK puts on every attempt of a request: how many retries came before.
RETRY_COUNT = "x-stainless-retry-count"
_PAUSE_HEADERS = (PAUSE_MS, PAUSE_KIND)


#: Every live core, for requests that name an open conversation by header.
_cores: weakref.WeakSet[KvturnCore] = weakref.WeakSet()


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
        _cores.add(self)

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

#: The turn of the request this context sent last, and the HTTP request of its last attempt:
#: retries (and redirects) are attempts of the same turn. Set by the request hook, which runs
#: in the caller's context, and read by the response hook right after.
_attempt: ContextVar[tuple[Turn, Any] | None] = ContextVar("kvturn_attempt", default=None)


def _conversation_of(request: Any) -> Conversation | None:
    conversation = _current.get()
    if conversation is not None:
        return conversation
    # Code that cannot carry a context (a thread pool without copy_context) can still name an
    # open conversation with the header itself.
    named = request.headers.get(CONVERSATION_ID)
    if not named:
        return None
    try:
        named = conversation_id_from_header(named)
    except ValueError:
        return None
    for core in list(_cores):
        found = core.conversations.get(named)
        if found is not None:
            return found
    return None


def attempt_started(request: Any) -> None:
    """Request hook: an attempt of a request made inside a conversation gets its turn's
    headers; the first attempt starts the turn, a retry (the SDK counts them in a header of
    its own) or a redirect (it carries the turn's id already) resumes it."""
    conversation = _conversation_of(request)
    if conversation is None:
        return
    headers = request.headers
    attempt = _attempt.get()
    turn = None if attempt is None else attempt[0]
    if (
        turn is not None
        and turn.conversation is conversation
        and (
            headers.get(RETRY_COUNT, "0") != "0"
            or headers.get(TURN_ID) == turn.turn_id  # (a redirect)
        )
    ):
        resume_turn(turn)
    else:
        if turn is not None and not turn.finished and turn.answer is None:
            # This context's last request got no answer at all and a new one starts: the last
            # one failed before any response (a connection error, say), which no hook sees.
            finish_turn(turn, False)
        turn = begin_turn(conversation)
    _attempt.set((turn, request))
    # Same-named headers set by the caller (or among the client's defaults) are replaced, and
    # a turn without a pause sends no pause headers, whatever a caller put there.
    ours = turn.headers
    if PAUSE_MS not in ours:
        for name in _PAUSE_HEADERS:
            if name in headers:
                del headers[name]
    for name, value in ours.items():
        headers[name] = value


def attempt_answered(response: Any, asynchronous: bool) -> Turn | None:
    """Response hook: the answer to an attempt of a turn. Its headers (plan, reused tokens,
    lease) are kept on the turn. A JSON body is for the hook to read at once (the SDK reads it
    at once too; read, it ends the turn): its turn is returned. Any other body (a stream) is
    watched, and ends the turn when it is closed."""
    attempt = _attempt.get()
    if attempt is None or response.request is not attempt[1]:
        return None
    turn = attempt[0]
    answer: Mapping[str, str] = response.headers
    turn.answer = answer
    turn.conversation.observe_lease(answer)
    if response.is_closed:  # read already: a body given whole (a mock transport's, say)
        body_read(turn, response.content)
        return None
    content_type = answer.get("content-type", "")
    if content_type.startswith("application/json"):
        return turn
    watcher = AsyncWatchedStream if asynchronous else WatchedStream
    response.stream = watcher(response.stream, turn, answer, content_type)
    return None


def _on_request(request: Any) -> None:
    attempt_started(request)


def _on_response(response: Any) -> None:
    turn = attempt_answered(response, False)
    if turn is not None:
        try:
            body = response.read()
        except BaseException:
            finish_turn(turn, False)
            raise
        body_read(turn, body)


async def _on_request_async(request: Any) -> None:
    attempt_started(request)


async def _on_response_async(response: Any) -> None:
    turn = attempt_answered(response, True)
    if turn is not None:
        try:
            body = await response.aread()
        except BaseException:
            finish_turn(turn, False)
            raise
        body_read(turn, body)


def install_hooks(http_client: Any, *, asynchronous: bool) -> None:
    """Add kvturn's event hooks to an httpx/httpx2 client (once: copies and other kvturn
    clients may share it). The response hook goes first, so the body is watched before any
    hook of the caller's reads it; the request hook last, so its headers are the ones sent."""
    on_request, on_response = (
        (_on_request_async, _on_response_async) if asynchronous else (_on_request, _on_response)
    )
    hooks = http_client.event_hooks
    if on_request in hooks.get("request", ()):
        return
    http_client.event_hooks = {
        "request": [*hooks.get("request", ()), on_request],
        "response": [on_response, *hooks.get("response", ())],
    }


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
