"""Tracked streams: the end of the reply and its tool calls, whatever the bytes' chunking."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from kvturn.client import AsyncOpenAI, OpenAI

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _event(delta: dict[str, Any], finish: str | None) -> bytes:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
TEXT = [_event({"role": "assistant", "content": ""}, None), _event({"content": "hi"}, None)]
# A text that speaks of "tool_calls": inside a JSON string the quotes are escaped.
TALK = [_event({"content": 'the "tool_calls" key'}, None)]
STOP = [_event({}, "stop"), b"data: [DONE]\n\n"]
AUTO = [_event({"role": "assistant", "tool_calls": [CALL]}, None), _event({}, "tool_calls")]
# A forced named tool_choice: tool calls, and a finish reason of "stop".
FORCED = [_event({"role": "assistant", "tool_calls": [CALL]}, None), *STOP]


def _client(chunks: list[bytes]) -> OpenAI:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, content=iter(list(chunks)), headers={"content-type": "text/event-stream"}
        )

    return OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )


def _rechunk(events: list[bytes], size: int) -> list[bytes]:
    data = b"".join(events)
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize(
    ("events", "tools"),
    [(TEXT + STOP, False), (TEXT + TALK + STOP, False), (TEXT + AUTO, True), (FORCED, True)],
)
@pytest.mark.parametrize("size", [None, 1, 7, 64])
def test_tool_calls_are_seen_however_the_bytes_arrive(
    events: list[bytes], tools: bool, size: int | None
) -> None:
    client = _client(events if size is None else _rechunk(events, size))
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = list(stream)
    assert len(chunks) == len([e for e in events if e != b"data: [DONE]\n\n"])
    (turn,) = conversation.turns
    assert turn.finished and turn.tool_calls is tools
    assert conversation.in_flight == 0
    client.close()


def test_iterating_with_next_sees_tool_calls_too() -> None:
    client = _client(TEXT + AUTO)
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(StopIteration):
            while True:
                next(stream)
    assert conversation.turns[0].tool_calls is True
    client.close()


@pytest.mark.parametrize(("events", "tools"), [(TEXT + TALK + STOP, False), (FORCED, True)])
async def test_async_streams_see_tool_calls_however_the_bytes_arrive(
    events: list[bytes], tools: bool
) -> None:
    chunks = _rechunk(events, 7)

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    client = AsyncOpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(answer)),
    )
    async with client.conversation() as conversation:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        async for _ in stream:
            pass
    assert conversation.turns[0].tool_calls is tools and conversation.in_flight == 0
    await client.close()
