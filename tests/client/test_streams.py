"""Replies followed at the HTTP client: their end and their tool calls, whatever the bytes'
chunking, their encoding, and whatever the SDK builds from them."""

from __future__ import annotations

import gc
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from kvturn_test_helpers import http
from openai.types.chat import ChatCompletionChunk

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


SSE = {"content-type": "text/event-stream"}


def _client(chunks: list[bytes], headers: dict[str, str] = SSE, **kwargs: Any) -> OpenAI:
    """A client whose every answer streams ``chunks`` (each a network chunk)."""

    def answer(request: Any) -> Any:
        return http.Response(200, content=iter(list(chunks)), headers=headers)

    return OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=http.Client(transport=http.MockTransport(answer), **kwargs),
    )


def _async_client(chunks: list[bytes]) -> AsyncOpenAI:
    """The async twin of :func:`_client`: each answer streams ``chunks``."""

    def answer(request: Any) -> Any:
        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return http.Response(200, content=body(), headers=SSE)

    return AsyncOpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=http.AsyncClient(transport=http.MockTransport(answer)),
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


def test_a_stream_class_of_the_callers_own_is_followed_too() -> None:
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


def test_with_streaming_response_ends_when_its_body_is_closed() -> None:
    client = _client(TEXT + AUTO)
    completions = client.chat.completions.with_streaming_response
    with client.conversation() as conversation:
        with completions.create(model="m", messages=MESSAGES, stream=True) as response:
            assert conversation.in_flight == 1  # headers only, so far
            chunks = list(response.parse())
        assert len(chunks) == 4
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
    client.close()


def test_a_raw_stream_sees_tool_calls() -> None:
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


def test_a_stream_closed_again_and_again_ends_its_turn_once() -> None:
    client = _client(TEXT + STOP)
    with client.conversation() as conversation:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert len(list(stream)) == 3
        assert stream.response.is_closed
        assert conversation.in_flight == 0 and conversation.turns[0].finished
        stream.response.close()
        stream.close()
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    client.close()


async def test_an_async_stream_closed_again_and_again_ends_its_turn_once() -> None:
    client = _async_client(AUTO + STOP)
    async with client.conversation() as conversation:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert len([chunk async for chunk in stream]) == 3
        assert stream.response.is_closed
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
        await stream.response.aclose()
        await stream.close()
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    await client.close()


def _completion_body(tool_calls: bool) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": "hi"}
    if tool_calls:  # a forced named tool_choice: tool calls, finish reason "stop"
        message["tool_calls"] = [CALL | {"function": {"name": "f", "arguments": "{}"}}]
    body = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
    return json.dumps(body, indent=2).encode()


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_a_whole_body_is_read_for_tool_calls_however_it_is_sent(tools: bool, encoding: str) -> None:
    body = _completion_body(tools)
    headers = {"content-type": "application/json"}
    if encoding == "gzip":
        body = gzip.compress(body)
        headers["content-encoding"] = "gzip"
    client = _client(_rechunk([body], 50), headers)
    with client.conversation() as conversation:
        reply = client.chat.completions.create(model="m", messages=MESSAGES)
        assert reply.choices[0].message.content == "hi"
        client.chat.completions.create(model="m", messages=MESSAGES)
    first, second = conversation.turns
    assert first.tool_calls is tools and second.pause is not None
    assert second.pause.kind == ("tool" if tools else "user")
    client.close()


def test_a_body_the_http_client_had_read_already_ends_its_turn() -> None:
    # A response made from whole content is read as it is made (a mock transport's).
    def answer(request: Any) -> Any:
        return http.Response(200, content=_completion_body(True))

    client = OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        heartbeats=False,
        release_on_exit=False,
        http_client=http.Client(transport=http.MockTransport(answer)),
    )
    with client.conversation() as conversation:
        client.chat.completions.create(model="m", messages=MESSAGES)
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is True
    client.close()


def test_the_callers_own_event_hooks_still_run_and_ours_are_added_once() -> None:
    seen: list[str] = []

    def on_request(request: Any) -> None:
        seen.append("request " + request.headers.get("x-conversation-id", "-"))

    def on_response(response: Any) -> None:
        seen.append(f"response {response.status_code}")

    client = _client(TEXT + STOP, event_hooks={"request": [on_request], "response": [on_response]})
    copy = client.with_options(timeout=3.0)
    assert [len(hooks) for hooks in client._client.event_hooks.values()] == [2, 2]
    with client.conversation("hooked") as conversation:
        list(copy.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    # The caller's request hook ran before kvturn's (which adds the headers last).
    assert seen == ["request -", "response 200"]
    assert conversation.turn_count == 1 and conversation.in_flight == 0
    client.close()


def test_an_unreadable_encoding_passes_through_and_still_ends_the_turn() -> None:
    client = _client([b"\x00\x01"], {"content-type": "text/event-stream", "content-encoding": "br"})
    with client.conversation() as conversation:
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=MESSAGES, stream=True
        ) as response:
            assert response.http_response.headers["content-encoding"] == "br"
        assert conversation.in_flight == 0 and conversation.turns[0].tool_calls is False
    client.close()


def test_a_request_that_fails_without_an_answer_ends_its_turn_by_the_next_one() -> None:
    fail = [True]

    def answer(request: Any) -> Any:
        if fail[0]:
            raise http.ConnectError("refused", request=request)
        return http.Response(200, content=_completion_body(False))

    client = OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        max_retries=1,
        heartbeats=False,
        release_on_exit=False,
        http_client=http.Client(transport=http.MockTransport(answer)),
    )
    with client.conversation() as conversation:
        with pytest.raises(openai.APIConnectionError):
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert conversation.turn_count == 1  # the retry was an attempt of the same turn
        fail[0] = False
        client.chat.completions.create(model="m", messages=MESSAGES)
        assert conversation.in_flight == 0 and conversation.turn_count == 2
    client.close()
