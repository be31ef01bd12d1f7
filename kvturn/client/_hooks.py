"""How a client follows its turns: the HTTP client's public event hooks, so a turn sees exactly
what goes on the wire whatever the SDK does above it (retries, streams, raw responses).

:func:`attempt_started` (the request hook) starts the turn, or resumes it for a retry, and puts
its headers on the request; :func:`attempt_answered` (the response hook) reads the gateway's
answer headers, then reads a JSON body itself (the turn ends there) or puts a watcher on a
stream's bytes that ends the turn when the stream does (``_bodies.py``). Known limit: a request
that fails before any answer (a connection error the SDK gives up on) is seen by no hook; its
turn ends when the next request of the same context starts.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Protocol

from kvturn.headers import (
    CONVERSATION_ID,
    PAUSE_KIND,
    PAUSE_MS,
    TURN_ID,
    conversation_id_from_header,
)

from ._bodies import AsyncWatchedStream, WatchedStream, body_read
from ._conversation import Conversation, Turn, _current, begin_turn, finish_turn, resume_turn

__all__ = ["attempt_answered", "attempt_started", "install_hooks", "live_cores"]

#: The header the openai SDK puts on every attempt of a request: how many retries came before.
RETRY_COUNT = "x-stainless-retry-count"
_PAUSE_HEADERS = (PAUSE_MS, PAUSE_KIND)


class Core(Protocol):
    """What the hooks ask of a client's core (``_base.KvturnCore``): its conversations."""

    @property
    def conversations(self) -> Mapping[str, Conversation]: ...


#: Every live client core (``_base.KvturnCore`` adds itself), for requests that name an open
#: conversation by header.
live_cores: weakref.WeakSet[Core] = weakref.WeakSet()

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
    for core in list(live_cores):
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
