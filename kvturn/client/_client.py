"""``OpenAI`` and ``AsyncOpenAI``: the official clients plus kvturn conversations.

They use only what the SDK offers for extension: constructor options, ``copy()``/
``with_options()``, a caller-supplied HTTP client (kvturn adds its event hooks to it, or to one
it makes with the SDK's defaults when none is given; see ``_hooks.py``), and ``post()``/
``delete()`` for the control calls. The two classes differ only where I/O does: a thread or a
task beats, ``with`` or ``async with`` opens a scope, a call is awaited or not.
"""

from __future__ import annotations

import contextlib
from contextvars import Token
from types import TracebackType
from typing import Any

import openai

from kvturn.control import HeartbeatRequest, heartbeat_path, release_path

from ._base import BaseKvturnClient, ControlCall, KvturnCore
from ._conversation import Conversation, _current
from ._headers import new_conversation_id
from ._heartbeat_workers import HeartbeatTask, HeartbeatThread
from ._heartbeats import ScheduledBeat, Worker

__all__ = ["AsyncConversationScope", "AsyncOpenAI", "ConversationScope", "OpenAI"]


class OpenAI(BaseKvturnClient, openai.OpenAI):
    """``openai.OpenAI`` that tags requests made inside ``conversation()`` scopes for kvturn.

    Takes every argument ``openai.OpenAI`` takes, plus the kvturn options below (or a whole
    :class:`KvturnSettings` as ``kvturn_settings``). ``copy()``/``with_options()`` share them,
    and share the conversations and the heartbeat thread. A caller's own ``http_client``
    (``openai.DefaultHttpxClient(...)`` or any httpx/httpx2 client the SDK takes) gets kvturn's
    event hooks added.

    Args:
        default_lease_seconds: lease assumed until the gateway sends ``X-Kvturn-Lease-Seconds``.
        max_pause_seconds: stop heartbeats once a pause has lasted this long.
        heartbeats: renew leases during pauses.
        release_on_exit: release conversations when their scope exits (per-scope override).
        control_timeout_seconds: timeout of a heartbeat or release call.
        clock: monotonic seconds; injectable for tests.
    """

    @classmethod
    def _kvturn_default_http_client(cls) -> Any:
        return openai.DefaultHttpxClient()

    @classmethod
    def _kvturn_worker(cls, core: KvturnCore) -> Worker:
        # Closes over the core only: the worker thread must not keep a client alive.
        def beat(entry: ScheduledBeat) -> float | None:
            plan = core.heartbeat_plan(entry, OpenAI)
            return None if plan is None else plan[0]._kvturn_send_heartbeat(entry, *plan[1:])

        return HeartbeatThread(core.schedule, beat, core.clock)

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
        if self._kvturn_forget_for_release(conversation_id):
            self._kvturn_release(conversation_id)

    def close(self) -> None:
        """Close the HTTP client and stop the heartbeat thread."""
        try:
            super().close()
        finally:
            self._kvturn.close()
            if isinstance(self._kvturn.worker, HeartbeatThread):
                self._kvturn.worker.close()

    def _kvturn_send_heartbeat(
        self, entry: ScheduledBeat, conversation: Conversation, body: HeartbeatRequest
    ) -> float | None:
        with ControlCall(self._kvturn, "heartbeat", conversation.id) as call:
            call.answer = self.post(
                heartbeat_path(conversation.id),
                cast_to=str,
                body=body.model_dump(),
                options=call.options,
            )
        return call.next_beat(entry)

    def _kvturn_release(self, conversation_id: str) -> None:
        with ControlCall(self._kvturn, "release", conversation_id) as call:
            self.delete(release_path(conversation_id), cast_to=str, options=call.options)


class AsyncOpenAI(BaseKvturnClient, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` that tags requests made inside ``conversation()`` scopes.

    Same options as :class:`OpenAI`; heartbeats run in one task on the loop the client is used
    from.
    """

    _kvturn_asynchronous = True

    @classmethod
    def _kvturn_default_http_client(cls) -> Any:
        return openai.DefaultAsyncHttpxClient()

    @classmethod
    def _kvturn_worker(cls, core: KvturnCore) -> Worker:
        async def beat(entry: ScheduledBeat) -> float | None:
            plan = core.heartbeat_plan(entry, AsyncOpenAI)
            return None if plan is None else await plan[0]._kvturn_send_heartbeat(entry, *plan[1:])

        return HeartbeatTask(core.schedule, beat, core.clock)

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
        if self._kvturn_forget_for_release(conversation_id):
            await self._kvturn_release(conversation_id)

    async def close(self) -> None:
        """Close the HTTP client and stop the heartbeat task."""
        try:
            await super().close()
        finally:
            self._kvturn.close()
            if isinstance(self._kvturn.worker, HeartbeatTask):
                await self._kvturn.worker.aclose()

    async def _kvturn_send_heartbeat(
        self, entry: ScheduledBeat, conversation: Conversation, body: HeartbeatRequest
    ) -> float | None:
        with ControlCall(self._kvturn, "heartbeat", conversation.id) as call:
            call.answer = await self.post(
                heartbeat_path(conversation.id),
                cast_to=str,
                body=body.model_dump(),
                options=call.options,
            )
        return call.next_beat(entry)

    async def _kvturn_release(self, conversation_id: str) -> None:
        with ControlCall(self._kvturn, "release", conversation_id) as call:
            await self.delete(release_path(conversation_id), cast_to=str, options=call.options)


class _Scope:
    """What the sync and async scopes share: opening and leaving the conversation."""

    def __init__(
        self, client: OpenAI | AsyncOpenAI, conversation_id: str | None, release: bool | None
    ) -> None:
        self._core = client._kvturn
        self._client = client
        #: The conversation id (known before entering, so it can be logged or stored).
        self.id = conversation_id if conversation_id is not None else new_conversation_id()
        self._release = client.kvturn_settings.release_on_exit if release is None else release
        self._conversation: Conversation | None = None
        self._token: Token[Conversation | None] | None = None

    def _open(self) -> Conversation:
        conversation = self._core.enter(self.id, self._client)
        self._conversation = conversation
        self._token = _current.set(conversation)
        return conversation

    def _left(self) -> bool:
        """Leave the scope; True when the gateway should now be told to release."""
        conversation, token = self._conversation, self._token
        if conversation is None or token is None:
            return False
        self._conversation = self._token = None
        # Left in another context than entered (a generator closed by someone else): the
        # entering context ends with it anyway.
        with contextlib.suppress(ValueError):
            _current.reset(token)
        return self._core.leave(conversation, release=self._release)


class ConversationScope(_Scope):
    """``with client.conversation(...) as conversation:`` for :class:`OpenAI`."""

    _client: OpenAI

    def __enter__(self) -> Conversation:
        return self._open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._left():
            self._client._kvturn_release(self.id)


class AsyncConversationScope(_Scope):
    """``async with client.conversation(...) as conversation:`` for :class:`AsyncOpenAI`."""

    _client: AsyncOpenAI

    async def __aenter__(self) -> Conversation:
        return self._open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._left():
            await self._client._kvturn_release(self.id)
