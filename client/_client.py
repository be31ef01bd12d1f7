"""``OpenAI`` and ``AsyncOpenAI``: the official clients plus kvturn conversations.

They hook the SDK's documented extension points. ``request()`` wraps one logical request,
retries included: it starts the turn (a turn id every retry reuses, the pause before it) and
ends it when the reply ends: on return, or for a stream when its HTTP response is closed
(exhausted, failed, closed or collected; see ``_streams.py``). ``_make_sse_decoder()`` gives
a stream made for a turn a decoder that watches its events for tool calls.
``_send_request()`` puts the turn's headers on each attempt's HTTP request and (sync) reads
each attempt's response headers: lease length, plan, reused tokens (the async client reads the
last attempt's, in ``_process_response()``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Coroutine
from contextvars import Token
from types import TracebackType
from typing import Any, Self, TypeVar
from weakref import ref as weak_ref

import httpx2
import openai
from openai import AsyncStream, Stream
from openai._constants import RAW_RESPONSE_HEADER
from openai._models import FinalRequestOptions
from openai._types import NotGiven, RequestOptions
from openai.types.chat import ChatCompletion

from kvturn.control import HeartbeatRequest, heartbeat_path, release_path

from ._base import (
    LEASE_KEY,
    BaseKvturnClient,
    KvturnCore,
    names_turn_headers,
    observe_response_headers,
    sending_turn,
    tag_request_headers,
)
from ._clock import Clock, monotonic_clock
from ._conversation import Conversation, _current, finish_turn
from ._headers import new_conversation_id
from ._heartbeats import HeartbeatTask, HeartbeatThread, ScheduledBeat
from ._settings import DEFAULT_LEASE_SECONDS, DEFAULT_MAX_PAUSE_SECONDS, KvturnSettings
from ._streams import late_stream_cls, reply_returned

__all__ = ["AsyncConversationScope", "AsyncOpenAI", "ConversationScope", "OpenAI"]

log = logging.getLogger("kvturn.client")

_R = TypeVar("_R")

# On a turn's path, a client of exactly these classes calls the SDK's methods as
# ``_SDK.method(self, ...)``, which finds what ``super().method(...)`` would (no kvturn class
# between them defines one) without making a super object and walking the MRO each call;
# read at call time, so a method patched onto the SDK's classes later is still the one called.
# A subclass of ours may put classes of its own in between: it goes through super().
_SDK = openai.OpenAI
_ASYNC_SDK = openai.AsyncOpenAI


def _settings_from(
    settings: KvturnSettings | None,
    default_lease_seconds: float,
    max_pause_seconds: float,
    heartbeats: bool,
    release_on_exit: bool,
    control_timeout_seconds: float,
) -> KvturnSettings:
    if settings is not None:
        return settings
    return KvturnSettings(
        default_lease_seconds=default_lease_seconds,
        max_pause_seconds=max_pause_seconds,
        heartbeats=heartbeats,
        release_on_exit=release_on_exit,
        control_timeout_seconds=control_timeout_seconds,
    )


def _control_options(core: KvturnCore) -> RequestOptions:
    # Control calls are best effort and must never hold the agent up: no SDK retries (the next
    # beat is the retry), a short timeout.
    return {"max_retries": 0, "timeout": core.settings.control_timeout_seconds}


def _reset(token: Token[Conversation | None]) -> None:
    # Exited in another context than entered (a generator closed by someone else): the
    # entering context ends with it anyway.
    with contextlib.suppress(ValueError):
        _current.reset(token)


def _owner_of(conversation: Conversation) -> Any:
    return conversation._owner() if conversation._owner is not None else None


class OpenAI(BaseKvturnClient, openai.OpenAI):
    """``openai.OpenAI`` that tags requests made inside ``conversation()`` scopes for kvturn.

    Takes every argument ``openai.OpenAI`` takes, plus the kvturn options below (or a whole
    :class:`KvturnSettings` as ``kvturn_settings``). ``copy()``/``with_options()`` share them,
    and share the conversations and the heartbeat thread.

    Args:
        default_lease_seconds: lease assumed until the gateway sends ``X-Kvturn-Lease-Seconds``.
        max_pause_seconds: stop heartbeats once a pause has lasted this long.
        heartbeats: renew leases during pauses.
        release_on_exit: release conversations when their scope exits (per-scope override).
        control_timeout_seconds: timeout of a heartbeat or release call.
        clock: monotonic seconds; injectable for tests.
    """

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
        _kvturn_core: KvturnCore | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if _kvturn_core is None:
            settings = _settings_from(
                kvturn_settings,
                default_lease_seconds,
                max_pause_seconds,
                heartbeats,
                release_on_exit,
                control_timeout_seconds,
            )
            _kvturn_core = KvturnCore(settings, clock or monotonic_clock)
            _kvturn_core.worker = HeartbeatThread(
                _kvturn_core.schedule, _sync_beat(_kvturn_core), _kvturn_core.clock
            )
        self._kvturn = _kvturn_core
        self._kvturn_replace_headers = names_turn_headers(self._custom_headers) or (
            names_turn_headers(self._client.headers)
        )

    def conversation(
        self, id: str | None = None, *, release: bool | None = None
    ) -> ConversationScope:
        """A scope whose requests belong to conversation ``id`` (a new uuid4 when ``None``).

        Use as ``with client.conversation() as conversation: ...``. Leaving the scope with
        ``release`` (default: the client's ``release_on_exit``) stops its heartbeats and tells
        the gateway to drop the conversation's KV. Leaving without it keeps the conversation
        open: heartbeats go on through the pause (up to ``max_pause_seconds``), and a later
        scope with the same id resumes its pause clock, so its first request reports the
        whole user pause. :meth:`release_conversation` ends such a conversation.
        """
        return ConversationScope(self, id, release)

    def release_conversation(self, conversation_id: str) -> None:
        """End a conversation left open (``release=False``): stop its heartbeats, forget its
        state and tell the gateway to free its KV. Failures are logged, never raised."""
        core = self._kvturn
        conversation = core.forget(conversation_id)
        if core._worth_releasing(conversation):
            self._kvturn_release(conversation_id)

    def copy(self, **kwargs: Any) -> Self:
        """``openai.OpenAI.copy`` that keeps the kvturn options, conversations and worker."""
        extra = {**kwargs.pop("_extra_kwargs", {}), "_kvturn_core": self._kvturn}
        return super().copy(**kwargs, _extra_kwargs=extra)

    with_options = copy

    def close(self) -> None:
        """Close the HTTP client and stop the heartbeat thread."""
        try:
            super().close()
        finally:
            core = getattr(self, "_kvturn", None)
            if core is not None:
                core.close()
                if isinstance(core.worker, HeartbeatThread):
                    core.worker.close()

    def request(  # type: ignore[override]
        self,
        cast_to: type[_R],
        options: FinalRequestOptions,
        *,
        stream: bool = False,
        stream_cls: Any = None,
    ) -> Any:
        # Outside any conversation (and not naming one in a header): straight through.
        conversation = _current.get()
        if conversation is None and type(options.headers) is NotGiven:
            return super().request(cast_to, options, stream=stream, stream_cls=stream_cls)
        turn = self._kvturn_begin(options, conversation)
        if turn is None:
            return super().request(cast_to, options, stream=stream, stream_cls=stream_cls)
        raw_response = False
        late = stream_cls
        if stream:
            headers = options.headers
            raw_response = type(headers) is dict and RAW_RESPONSE_HEADER in headers
            if raw_response:  # its stream is built when the caller parses it
                late = late_stream_cls(stream_cls, asynchronous=False) or stream_cls
        token = sending_turn.set(turn)
        try:
            if type(self) is OpenAI:  # (see _SDK)
                result: Any = _SDK.request(self, cast_to, options, stream=stream, stream_cls=late)
            else:
                result = super().request(cast_to, options, stream=stream, stream_cls=late)
        except BaseException:
            finish_turn(turn, False)
            raise
        finally:
            sending_turn.reset(token)
        # The common cases inline; reply_returned() has them all.
        if stream:
            if type(result) is Stream:
                response = result.response
                if type(response) is httpx2.Response:  # (has a __dict__ to hook)
                    response.close = turn._end_reply  # type: ignore[method-assign]
                    turn._response = weak_ref(response, turn._response_gone)
                    return result
        elif type(result) is ChatCompletion:
            tools = False
            for choice in result.choices:
                if choice.finish_reason == "tool_calls" or choice.message.tool_calls:
                    tools = True
            finish_turn(turn, tools)
            return result
        reply_returned(turn, result, stream, raw_response, False)
        return result

    def _send_request(
        self, request: httpx2.Request, *, stream: bool, **kwargs: Any
    ) -> httpx2.Response:
        # Each attempt of a turn: its headers go on here (the last hook before sending; one
        # override instead of two with _prepare_request), its answer is read on return.
        turn = sending_turn.get()
        if turn is None:
            return super()._send_request(request, stream=stream, **kwargs)
        headers = request.headers
        if turn.replace_headers:
            tag_request_headers(headers, turn.header_items)
        else:  # tag_request_headers() inline, without the search for same-named headers
            if headers._encoding is None:
                headers.encoding  # noqa: B018  (see tag_request_headers)
            headers._list.extend(turn.header_items)
        if type(self) is OpenAI:  # (see _SDK)
            response = _SDK._send_request(self, request, stream=stream, **kwargs)
        else:
            response = super()._send_request(request, stream=stream, **kwargs)
        # observe_response_headers() inline, for its common case: the lease as last time.
        raw = response.headers._list
        turn.answer = raw
        conversation = turn.conversation
        at = conversation._lease_at
        if not (
            at < len(raw) and raw[at][1] == LEASE_KEY and raw[at][2] == conversation._lease_raw
        ):
            observe_response_headers(turn, response.headers)
        return response

    # -- control API --------------------------------------------------------------------------

    def _kvturn_send_heartbeat(
        self, entry: ScheduledBeat, conversation: Conversation, body: HeartbeatRequest
    ) -> float | None:
        core = self._kvturn
        outside = _current.set(None)  # a control call is no turn of any conversation
        try:
            response = self.post(
                heartbeat_path(conversation.id),
                cast_to=httpx2.Response,
                body=body.model_dump(),
                options=_control_options(core),
            )
        except openai.APIStatusError as exc:
            refused = core.control_failed("heartbeat", conversation.id, exc.status_code)
            return None if refused else entry.interval
        except Exception as exc:
            log.debug("kvturn: heartbeat error: %r", exc)
            core.control_failed("heartbeat", conversation.id, None)
            return entry.interval
        finally:
            _current.reset(outside)
        return core.heartbeat_answered(entry, response.content)

    def _kvturn_release(self, conversation_id: str) -> None:
        core = self._kvturn
        outside = _current.set(None)  # a control call is no turn of any conversation
        try:
            self.delete(
                release_path(conversation_id),
                cast_to=httpx2.Response,
                options=_control_options(core),
            )
        except openai.APIStatusError as exc:
            core.control_failed("release", conversation_id, exc.status_code)
        except Exception as exc:
            log.debug("kvturn: release error: %r", exc)
            core.control_failed("release", conversation_id, None)
        finally:
            _current.reset(outside)


def _sync_beat(core: KvturnCore) -> Any:
    # Closes over the core only: the worker thread must not keep a client alive.
    def beat(entry: ScheduledBeat) -> float | None:
        plan = core.heartbeat_body(entry)
        if plan is None:
            return None
        conversation, body = plan
        owner = _owner_of(conversation)
        if not isinstance(owner, OpenAI):
            return None
        return owner._kvturn_send_heartbeat(entry, conversation, body)

    return beat


def _async_beat(core: KvturnCore) -> Any:
    async def beat(entry: ScheduledBeat) -> float | None:
        plan = core.heartbeat_body(entry)
        if plan is None:
            return None
        conversation, body = plan
        owner = _owner_of(conversation)
        if not isinstance(owner, AsyncOpenAI):
            return None
        return await owner._kvturn_send_heartbeat(entry, conversation, body)

    return beat


class AsyncOpenAI(BaseKvturnClient, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` that tags requests made inside ``conversation()`` scopes.

    Same options as :class:`OpenAI`; heartbeats run in one task on the loop the client is used
    from.
    """

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
        _kvturn_core: KvturnCore | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if _kvturn_core is None:
            settings = _settings_from(
                kvturn_settings,
                default_lease_seconds,
                max_pause_seconds,
                heartbeats,
                release_on_exit,
                control_timeout_seconds,
            )
            _kvturn_core = KvturnCore(settings, clock or monotonic_clock)
            _kvturn_core.worker = HeartbeatTask(
                _kvturn_core.schedule, _async_beat(_kvturn_core), _kvturn_core.clock
            )
        self._kvturn = _kvturn_core
        self._kvturn_replace_headers = names_turn_headers(self._custom_headers) or (
            names_turn_headers(self._client.headers)
        )

    def conversation(
        self, id: str | None = None, *, release: bool | None = None
    ) -> AsyncConversationScope:
        """A scope whose requests belong to conversation ``id``; ``async with`` it.

        Same semantics as :meth:`OpenAI.conversation`; the release is awaited on exit.
        """
        return AsyncConversationScope(self, id, release)

    async def release_conversation(self, conversation_id: str) -> None:
        """End a conversation left open (``release=False``): stop its heartbeats, forget its
        state and tell the gateway to free its KV. Failures are logged, never raised."""
        core = self._kvturn
        conversation = core.forget(conversation_id)
        if core._worth_releasing(conversation):
            await self._kvturn_release(conversation_id)

    def copy(self, **kwargs: Any) -> Self:
        """``openai.AsyncOpenAI.copy`` that keeps the kvturn options, conversations and worker."""
        extra = {**kwargs.pop("_extra_kwargs", {}), "_kvturn_core": self._kvturn}
        return super().copy(**kwargs, _extra_kwargs=extra)

    with_options = copy

    async def close(self) -> None:
        """Close the HTTP client and stop the heartbeat task."""
        try:
            await super().close()
        finally:
            core = getattr(self, "_kvturn", None)
            if core is not None:
                core.close()
                if isinstance(core.worker, HeartbeatTask):
                    await core.worker.aclose()

    async def request(  # type: ignore[override]
        self,
        cast_to: type[_R],
        options: FinalRequestOptions,
        *,
        stream: bool = False,
        stream_cls: Any = None,
    ) -> Any:
        # Outside any conversation (and not naming one in a header): straight through.
        conversation = _current.get()
        if conversation is None and type(options.headers) is NotGiven:
            return await super().request(cast_to, options, stream=stream, stream_cls=stream_cls)
        turn = self._kvturn_begin(options, conversation)
        if turn is None:
            return await super().request(cast_to, options, stream=stream, stream_cls=stream_cls)
        raw_response = False
        late = stream_cls
        if stream:
            headers = options.headers
            raw_response = type(headers) is dict and RAW_RESPONSE_HEADER in headers
            if raw_response:  # its stream is built when the caller parses it
                late = late_stream_cls(stream_cls, asynchronous=True) or stream_cls
        token = sending_turn.set(turn)
        try:
            if type(self) is AsyncOpenAI:  # (see _SDK)
                result: Any = await _ASYNC_SDK.request(
                    self, cast_to, options, stream=stream, stream_cls=late
                )
            else:
                result = await super().request(cast_to, options, stream=stream, stream_cls=late)
        except BaseException:
            finish_turn(turn, False)
            raise
        finally:
            sending_turn.reset(token)
        # The common cases inline; reply_returned() has them all.
        if stream:
            if type(result) is AsyncStream:
                response = result.response
                if type(response) is httpx2.Response:  # (has a __dict__ to hook)
                    response.aclose = turn._aend_reply  # type: ignore[method-assign]
                    turn._response = weak_ref(response, turn._response_gone)
                    return result
        elif type(result) is ChatCompletion:
            tools = False
            for choice in result.choices:
                if choice.finish_reason == "tool_calls" or choice.message.tool_calls:
                    tools = True
            finish_turn(turn, tools)
            return result
        reply_returned(turn, result, stream, raw_response, True)
        return result

    # Both hooks are plain functions handing back the SDK's coroutine: an ``async def``
    # override would add a coroutine of its own to every attempt.

    def _send_request(  # type: ignore[override]
        self, request: httpx2.Request, *, stream: bool, **kwargs: Any
    ) -> Coroutine[Any, Any, httpx2.Response]:
        # Each attempt of a turn: its headers go on here, the last hook before sending.
        turn = sending_turn.get()
        if turn is not None:
            headers = request.headers
            if turn.replace_headers:
                tag_request_headers(headers, turn.header_items)
            else:  # tag_request_headers() inline, without the search for same-named headers
                if headers._encoding is None:
                    headers.encoding  # noqa: B018  (see tag_request_headers)
                headers._list.extend(turn.header_items)
            if type(self) is AsyncOpenAI:  # (see _SDK)
                return _ASYNC_SDK._send_request(self, request, stream=stream, **kwargs)
        return super()._send_request(request, stream=stream, **kwargs)

    def _process_response(  # type: ignore[override]
        self,
        *,
        cast_to: Any,
        options: FinalRequestOptions,
        response: httpx2.Response,
        stream: bool,
        stream_cls: Any,
        retries_taken: int = 0,
    ) -> Coroutine[Any, Any, Any]:
        # The answer of the turn's last attempt (earlier ones failed and were retried).
        turn = sending_turn.get()
        if turn is not None:
            # observe_response_headers() inline, for its common case: the lease as last time.
            raw = response.headers._list
            turn.answer = raw
            conversation = turn.conversation
            at = conversation._lease_at
            if not (
                at < len(raw) and raw[at][1] == LEASE_KEY and raw[at][2] == conversation._lease_raw
            ):
                observe_response_headers(turn, response.headers)
        if turn is not None and type(self) is AsyncOpenAI:  # (see _SDK)
            return _ASYNC_SDK._process_response(
                self,
                cast_to=cast_to,
                options=options,
                response=response,
                stream=stream,
                stream_cls=stream_cls,
                retries_taken=retries_taken,
            )
        return super()._process_response(
            cast_to=cast_to,
            options=options,
            response=response,
            stream=stream,
            stream_cls=stream_cls,
            retries_taken=retries_taken,
        )

    # -- control API --------------------------------------------------------------------------

    async def _kvturn_send_heartbeat(
        self, entry: ScheduledBeat, conversation: Conversation, body: HeartbeatRequest
    ) -> float | None:
        core = self._kvturn
        outside = _current.set(None)  # a control call is no turn of any conversation
        try:
            response = await self.post(
                heartbeat_path(conversation.id),
                cast_to=httpx2.Response,
                body=body.model_dump(),
                options=_control_options(core),
            )
        except openai.APIStatusError as exc:
            refused = core.control_failed("heartbeat", conversation.id, exc.status_code)
            return None if refused else entry.interval
        except Exception as exc:
            log.debug("kvturn: heartbeat error: %r", exc)
            core.control_failed("heartbeat", conversation.id, None)
            return entry.interval
        finally:
            _current.reset(outside)
        return core.heartbeat_answered(entry, response.content)

    async def _kvturn_release(self, conversation_id: str) -> None:
        core = self._kvturn
        outside = _current.set(None)  # a control call is no turn of any conversation
        try:
            await self.delete(
                release_path(conversation_id),
                cast_to=httpx2.Response,
                options=_control_options(core),
            )
        except openai.APIStatusError as exc:
            core.control_failed("release", conversation_id, exc.status_code)
        except Exception as exc:
            log.debug("kvturn: release error: %r", exc)
            core.control_failed("release", conversation_id, None)
        finally:
            _current.reset(outside)


class ConversationScope:
    """``with client.conversation(...) as conversation:`` for :class:`OpenAI`."""

    def __init__(self, client: OpenAI, conversation_id: str | None, release: bool | None) -> None:
        self._client = client
        #: The conversation id (known before entering, so it can be logged or stored).
        self.id = conversation_id if conversation_id is not None else new_conversation_id()
        self._release = client.kvturn_settings.release_on_exit if release is None else release
        self._conversation: Conversation | None = None
        self._token: Token[Conversation | None] | None = None

    def __enter__(self) -> Conversation:
        conversation = self._client._kvturn.enter(self.id, self._client)
        self._conversation = conversation
        self._token = _current.set(conversation)
        return conversation

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conversation, token = self._conversation, self._token
        if conversation is None or token is None:
            return
        self._conversation = self._token = None
        _reset(token)
        if self._client._kvturn.leave(conversation, release=self._release):
            self._client._kvturn_release(conversation.id)


class AsyncConversationScope:
    """``async with client.conversation(...) as conversation:`` for :class:`AsyncOpenAI`."""

    def __init__(
        self, client: AsyncOpenAI, conversation_id: str | None, release: bool | None
    ) -> None:
        self._client = client
        #: The conversation id (known before entering, so it can be logged or stored).
        self.id = conversation_id if conversation_id is not None else new_conversation_id()
        self._release = client.kvturn_settings.release_on_exit if release is None else release
        self._conversation: Conversation | None = None
        self._token: Token[Conversation | None] | None = None

    async def __aenter__(self) -> Conversation:
        conversation = self._client._kvturn.enter(self.id, self._client)
        self._conversation = conversation
        self._token = _current.set(conversation)
        return conversation

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conversation, token = self._conversation, self._token
        if conversation is None or token is None:
            return
        self._conversation = self._token = None
        _reset(token)
        if self._client._kvturn.leave(conversation, release=self._release):
            await self._client._kvturn_release(conversation.id)
