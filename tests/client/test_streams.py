"""Streamed replies: their end and their tool calls, whatever the bytes' chunking and whatever
builds the stream."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

import kvturn.client._base
import kvturn.client._streams
from kvturn.client import AsyncOpenAI, OpenAI
from kvturn.client._streams import SDK_DECODER_IS_PLAIN

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


def _async_client(chunks: list[bytes]) -> AsyncOpenAI:
    """The async twin of :func:`_client`: each answer streams ``chunks``."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return httpx2.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    return AsyncOpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(answer)),
    )


def _rechunk(events: list[bytes], size: int) -> list[bytes]:
    data = b"".join(events)
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.fixture(params=["sdk decoder", "any decoder"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of watching events: the fast one for the SDK's own decoder, and the wrapper
    for any other (another SDK version's, a client's own)."""
    if request.param == "any decoder":
        monkeypatch.setattr(kvturn.client._base, "SDK_DECODER_IS_PLAIN", False)
        monkeypatch.setattr(kvturn.client._streams, "SDK_DECODER_IS_PLAIN", False)
    return str(request.param)


def test_the_installed_sdk_takes_the_fast_path() -> None:
    # If an SDK upgrade changes how it decodes events, the wrapper takes over (one more
    # generator step per event): this says so here rather than in a benchmark.
    assert SDK_DECODER_IS_PLAIN


@pytest.mark.parametrize(
    ("events", "tools"),
    [(TEXT + STOP, False), (TEXT + TALK + STOP, False), (TEXT + AUTO, True), (FORCED, True)],
)
@pytest.mark.parametrize("size", [None, 1, 7, 64])
def test_tool_calls_are_seen_however_the_bytes_arrive(
    events: list[bytes], tools: bool, size: int | None, decoder: str
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
    events: list[bytes], tools: bool, decoder: str
) -> None:
    client = _async_client(_rechunk(events, 7))
    async with client.conversation() as conversation:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        async for _ in stream:
            pass
    assert conversation.turns[0].tool_calls is tools and conversation.in_flight == 0
    await client.close()


def test_a_stream_dropped_before_it_is_read_ends_its_turn_when_collected() -> None:
    client = _client(TEXT + STOP)
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert conversation.in_flight == 1
        del stream
        gc.collect()
        assert conversation.in_flight == 0
        (turn,) = conversation.turns
        assert turn.finished and turn.tool_calls is False
    client.close()


def test_a_stream_class_of_the_callers_own_is_followed_too(decoder: str) -> None:
    class MyStream(openai.Stream[ChatCompletionChunk]):
        pass

    client = _client(TEXT + AUTO)
    with client.conversation() as conversation:
        stream = client.post(
            "/chat/completions",
            body={"model": "m", "messages": MESSAGES, "stream": True},
            cast_to=ChatCompletionChunk,
            stream=True,
            stream_cls=MyStream,
        )
        assert type(stream) is MyStream and conversation.in_flight == 1
        assert len(list(stream)) == 4
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
    client.close()


def test_with_streaming_response_ends_when_its_body_is_closed(decoder: str) -> None:
    client = _client(TEXT + AUTO)
    completions = client.chat.completions.with_streaming_response
    with client.conversation() as conversation:
        with completions.create(model="m", messages=MESSAGES, stream=True) as response:
            assert conversation.in_flight == 1  # headers only, so far
            chunks = list(response.parse())
        assert len(chunks) == 4
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
    client.close()


def test_a_raw_stream_sees_tool_calls(decoder: str) -> None:
    client = _client(FORCED)
    with client.conversation() as conversation:
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, stream=True
        )
        assert conversation.in_flight == 1
        assert len(list(raw.parse())) == 2
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
    client.close()


def test_closing_a_stream_early_ends_the_turn_with_what_was_seen() -> None:
    client = _client(AUTO + STOP)
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        next(stream)  # the tool call
        stream.close()
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
        stream.close()  # a second close changes nothing
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    client.close()


def test_a_finished_streams_response_closes_as_its_own_again() -> None:
    client = _client(TEXT + STOP)
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        hook = stream.response.close  # a reference kept to the hook, e.g. by an exit stack
        assert "close" in vars(stream.response)
        assert len(list(stream)) == 3
        # The turn ended once; later closes (the SDK's own, the caller's) are the response's.
        assert "close" not in vars(stream.response) and stream.response.is_closed
        assert conversation.in_flight == 0 and conversation.turns[0].finished
        hook()
        stream.close()
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    client.close()


async def test_a_finished_async_streams_response_closes_as_its_own_again() -> None:
    client = _async_client(AUTO + STOP)
    async with client.conversation() as conversation:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        hook = stream.response.aclose
        assert "aclose" in vars(stream.response)
        assert len([chunk async for chunk in stream]) == 3
        assert "aclose" not in vars(stream.response) and stream.response.is_closed
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
        await hook()  # called again: nothing left to do, and it can still be awaited
        await stream.close()
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    await client.close()
