"""A chat turn's reply answered the Responses way (a Response object, or Responses SSE events),
and stored once complete for the turns chained to it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from kvturn import headers as h
from kvturn.gateway.replies import Reply
from kvturn.gateway.responses.objects import assistant_message, response_from_chat
from kvturn.gateway.responses.stream import ResponsesStream
from kvturn.gateway.responses.translate import Translated
from kvturn.gateway.state.response_store import ResponseStore


async def answer_as_response(
    t: Translated, reply: Reply, store: ResponseStore, tenant: str
) -> Reply:
    """A chat turn's reply, answered the Responses way; stored in ``store`` (when asked) once
    complete, with the conversation it belonged to, for a turn chained to it."""
    echoed = reply.headers.get(h.CONVERSATION_ID)
    conversation_id = None if echoed is None else h.conversation_id_from_header(echoed)

    async def done(response: dict[str, Any]) -> None:
        reply_message = assistant_message(response["output"])
        history = t.history if reply_message is None else [*t.history, reply_message]
        if t.request.store:
            await store.put(tenant, response, history, conversation_id)
        if t.request.conversation is not None and t.conversation_id is not None:
            await store.put_conversation(tenant, t.conversation_id, history)

    cached = int(reply.headers.get(h.REUSED_TOKENS, "0") or 0)
    return await responses_reply(t, reply, cached, done)


async def responses_reply(
    t: Translated,
    reply: Reply,
    cached: int,
    on_done: Callable[[dict[str, Any]], Awaitable[None]],
) -> Reply:
    """The chat turn's reply as the Responses API answers; errors pass through unchanged."""
    if reply.status != 200:
        return reply
    if reply.stream is not None:
        stream = ResponsesStream(reply.stream, t, cached, on_done)
        return Reply(200, headers=reply.headers, stream=stream)
    response = response_from_chat(t, orjson.loads(reply.body), cached)
    await on_done(response)
    return Reply(200, orjson.dumps(response), reply.headers)
