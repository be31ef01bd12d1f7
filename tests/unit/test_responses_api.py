"""The Responses API on the gateway: translation to chat turns (pure) and the HTTP surface
against a fake engine (the openai SDK's own Responses types parse every answer)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pydantic
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.errors import InvalidRequest, StateUnavailable
from kvturn.gateway.responses.objects import assistant_message
from kvturn.gateway.responses.stream import ResponsesStream
from kvturn.gateway.responses.translate import ResponseNotFound, translate
from kvturn.gateway.state.redis_client import RedisState
from kvturn.gateway.state.response_store import MemoryResponseStore, RedisResponseStore
from tests.gateway_fixtures import (
    ChunkStream,
    RedisServer,
    free_port,
    running_fake_engine,
    running_gateway,
    running_redis,
)

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
}


def _empty() -> MemoryResponseStore:
    return MemoryResponseStore(max_entries=10, ttl_s=60)


# ---- translation -----------------------------------------------------------------------------


async def test_input_items_become_chat_messages_as_vllm_builds_them() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "count files"},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "wc", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a b"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
            {"type": "reasoning", "id": "r", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Two.", "annotations": []}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
        ],
        "max_output_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,  # a vLLM extra its Responses server takes too
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "lookup"},
    }
    t = await translate(body, _empty(), "")
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "count files"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "wc", "arguments": '{"a":1}'},
                },
            ],
        },
        {"role": "tool", "content": "a b", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]
    assert t.chat["max_tokens"] == 7 and t.chat["temperature"] == 0 and t.chat["ignore_eos"]
    assert t.chat["tools"] == [
        {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    ]
    assert t.chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert "stream" not in t.chat
    # The instructions are not part of what a chained turn starts from.
    assert t.history == t.chat["messages"][1:]


async def test_chained_turn_starts_from_the_stored_history_and_its_conversation() -> None:
    store = _empty()
    reply = assistant_message(
        [{"type": "function_call", "call_id": "c9", "name": "ls", "arguments": "{}"}]
    )
    await store.put("t1", {"id": "resp_1"}, [{"role": "user", "content": "hi"}, reply], "conv-7")
    stored = await store.get("t1", "resp_1")
    assert stored is not None
    body = {
        "model": "m",
        "previous_response_id": "resp_1",
        "instructions": "New rules.",
        "input": [{"type": "function_call_output", "call_id": "c9", "output": "x.txt"}],
        "stream": True,
    }
    with pytest.raises(ResponseNotFound):  # another tenant's response is not found
        await translate(body, store, "t2")
    t = await translate(body, store, "t1")
    assert t.conversation_id == "conv-7"
    assert t.chat["messages"] == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "x.txt", "tool_call_id": "c9"},
    ]
    assert t.chat["stream"] is True and t.chat["stream_options"] == {"include_usage": True}
    # The stored history is not changed by the turns built on it, even one whose input merges
    # into its last message (a second call of the same assistant turn).
    branch = await translate(
        {
            "previous_response_id": "resp_1",
            "input": [{"type": "function_call", "call_id": "c10", "name": "ls", "arguments": ""}],
        },
        store,
        "t1",
    )
    assert len(branch.chat["messages"][-1]["tool_calls"]) == 2
    again = await store.get("t1", "resp_1")
    assert again is not None and len(again.messages) == 2
    assert len(again.messages[1]["tool_calls"]) == 1


async def test_conversation_parameter_carries_its_history_like_openais_conversations() -> None:
    store = _empty()
    first = await translate({"input": "hi", "conversation": "c1", "instructions": "x"}, store, "t")
    assert first.conversation_id == "c1" and first.chat["messages"][-1]["content"] == "hi"
    reply = {"role": "assistant", "content": "hello"}
    await store.put_conversation("t", "c1", [*first.history, reply])
    second = await translate({"input": "more", "conversation": {"id": "c1"}}, store, "t")
    assert second.chat["messages"] == [
        {"role": "user", "content": "hi"},
        reply,
        {"role": "user", "content": "more"},
    ]
    other = await translate({"input": "more", "conversation": "c1"}, store, "someone-else")
    assert other.chat["messages"] == [{"role": "user", "content": "more"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "previous_response_id": "a", "conversation": "b"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "store": "yes"}, "store"),
        ({"input": "hi", "background": True}, "background"),
        # Were a 500 (param passed positionally) and a 400 naming '' (a filter ate "stream").
        ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"input": "hi", "stream": "yes"}, "stream"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)
async def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await translate(body, _empty(), "")
    assert caught.value.param == param


async def test_unknown_previous_response_is_a_404_with_the_apis_code() -> None:
    with pytest.raises(ResponseNotFound) as caught:
        await translate({"input": "hi", "previous_response_id": "resp_gone"}, _empty(), "")
    assert caught.value.status == 404
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"


async def test_store_is_bounded_expiring_and_per_tenant() -> None:
    now = [0.0]
    store = MemoryResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        await store.put("t1", {"id": rid}, [], None)
    assert await store.get("t1", "a") is None  # the least recently used went first
    assert await store.get("t1", "b") is not None and await store.get("t2", "b") is None
    now[0] = 10.0
    assert await store.get("t1", "b") is None and await store.get("t1", "c") is None  # expired
    await store.put("t1", {"id": "d"}, [], None)
    assert await store.delete("t2", "d") is False and await store.delete("t1", "d") is True
    assert await store.get("t1", "d") is None


# ---- over HTTP, fake engine ------------------------------------------------------------------


#: An input long enough that its turn's KV is worth reusing (the fake engine counts a token a
#: byte; the gateway reuses from 64 held tokens).
ASK = "Read the repository and list the modules that import the wire contract."


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with running_fake_engine() as url:
        config = GatewayConfig(prefill=endpoints([url]), decode=endpoints([url], [url]))
        with running_gateway(config) as running:
            yield running.url


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)


def test_response_chained_by_previous_id_reuses_and_can_be_fetched_and_deleted(
    client: openai.OpenAI, gateway: str
) -> None:
    first = client.responses.with_raw_response.create(model="fake", input=ASK)
    response = first.parse()
    assert response.status == "completed" and response.output_text == "ok"
    assert response.usage is not None and response.usage.output_tokens == 2
    assert first.headers["x-kvturn-plan"] == "recompute"
    conversation = first.headers["x-conversation-id"]
    second = client.responses.with_raw_response.create(
        model="fake", input="and?", previous_response_id=response.id
    )
    # The chained request extends the first: the holder continues it.
    assert second.headers["x-kvturn-plan"] == "decode-local"
    assert second.headers["x-conversation-id"] == conversation
    chained = second.parse()
    assert chained.previous_response_id == response.id
    assert chained.usage is not None and chained.usage.input_tokens_details.cached_tokens > 0
    fetched = client.responses.retrieve(chained.id)
    assert fetched.model_dump() == chained.model_dump()
    client.responses.delete(chained.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(chained.id)
    deleted = httpx.delete(f"{gateway}/v1/responses/{chained.id}")
    assert deleted.status_code == 404 and deleted.json()["error"]["type"] == "invalid_request_error"


def test_streamed_responses_events_in_order_and_stored_at_the_end(client: openai.OpenAI) -> None:
    with client.responses.stream(model="fake", input="hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 2
    assert final.output_text == "ok" and final.usage is not None
    assert client.responses.retrieve(final.id).output_text == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_come_back_as_items_and_chain(client: openai.OpenAI, stream: bool) -> None:
    asked: dict[str, Any] = {
        "model": "fake",
        "input": "look it up",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "lookup"},
    }
    if stream:
        with client.responses.stream(**asked) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        response = client.responses.create(**asked)
    [call] = response.output
    assert call.type == "function_call"
    assert (call.name, call.arguments, call.call_id) == ("lookup", '{"x": 1}', "call_fake1")
    answer = client.responses.with_raw_response.create(
        model="fake",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
    )
    # Not planned by a bound: this request carries no tools, so it renders another prompt
    # than the one whose call it answers (no tools block at its start). Counted, its start
    # does not match what the holder keeps: a pull is planned (history-edited) and prefill,
    # which reads only a verified common prefix, finds none to read.
    assert answer.headers["x-kvturn-plan"] == "recompute"
    assert answer.headers["x-kvturn-plan-reason"] == "no-common-prefix"
    assert answer.parse().output_text == "ok"


def test_unknown_previous_response_and_unstored_ones_get_the_apis_404(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="fake", input="hi", previous_response_id="resp_nope")
    assert caught.value.code == "previous_response_not_found"
    unstored = client.responses.create(model="fake", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="fake", input="x", previous_response_id=unstored.id)


def test_store_false_with_the_full_input_reuses_by_its_messages(client: openai.OpenAI) -> None:
    first = client.responses.create(model="fake", input=ASK, store=False)
    following = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "more"},
    ]
    second = client.responses.with_raw_response.create(model="fake", input=following, store=False)
    assert second.headers["x-kvturn-plan"] == "decode-local"
    assert second.headers["x-conversation-id"].startswith("implicit-")


def test_conversation_parameter_names_the_conversation(client: openai.OpenAI) -> None:
    for plan in ("recompute", "decode-local"):
        raw = client.responses.with_raw_response.create(
            model="fake", input=ASK, conversation="conv_resp_param"
        )
        assert raw.headers["x-kvturn-plan"] == plan
        assert raw.headers["x-conversation-id"] == "conv_resp_param"
        assert raw.parse().conversation is not None


# ---- Redis state -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


async def test_redis_store_keeps_responses_and_conversations_per_tenant_until_expiry(
    redis_server: RedisServer,
) -> None:
    redis = RedisState(redis_server.url, timeout_s=0.5, prefix=f"t{uuid.uuid4().hex}:")
    store = RedisResponseStore(redis, ttl_s=0.5)
    try:
        message = [{"role": "user", "content": "hi"}]
        await store.put("t1", {"id": "resp_a", "output": []}, message, "conv-1")
        found = await store.get("t1", "resp_a")
        assert found is not None
        assert (found.response["id"], found.messages, found.conversation_id) == (
            "resp_a", message, "conv-1"
        )  # fmt: skip
        assert await store.get("t2", "resp_a") is None  # another tenant's
        await store.put_conversation("t1", "c", message)
        assert await store.conversation("t1", "c") == message
        assert await store.conversation("t2", "c") is None
        assert await store.delete("t2", "resp_a") is False
        assert await store.delete("t1", "resp_a") is True
        assert await store.get("t1", "resp_a") is None
        await store.put("t1", {"id": "resp_b"}, [], None)
        await asyncio.sleep(0.8)
        assert await store.get("t1", "resp_b") is None  # expired
        assert await store.conversation("t1", "c") is None
    finally:
        await redis.close()


async def test_redis_outage_is_a_503_on_lookup_and_a_counted_miss_on_store() -> None:
    failed: list[str] = []
    redis = RedisState(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5, on_error=failed.append)
    store = RedisResponseStore(redis, 60)
    try:
        await store.put("t", {"id": "resp_x"}, [], None)  # logged and counted, not raised
        with pytest.raises(StateUnavailable) as caught:
            await store.get("t", "resp_x")
        assert caught.value.status == 503 and caught.value.code == "state_unavailable"
        assert failed == ["put_response", "get_response"]
    finally:
        await redis.close()


def test_chained_response_survives_a_gateway_restart_with_redis_state(
    redis_server: RedisServer,
) -> None:
    with running_fake_engine() as url:
        config = GatewayConfig(
            prefill=endpoints([url]), decode=endpoints([url], [url]), state=redis_server.url
        )
        with running_gateway(config) as first:
            client = openai.OpenAI(base_url=first.url + "/v1", api_key="-", max_retries=0)
            made = client.responses.create(model="fake", input="remember me")
        with running_gateway(config) as second:  # a new process's worth of memory
            client = openai.OpenAI(base_url=second.url + "/v1", api_key="-", max_retries=0)
            assert client.responses.retrieve(made.id).output_text == "ok"
            chained = client.responses.create(
                model="fake", input="and now?", previous_response_id=made.id
            )
            assert chained.previous_response_id == made.id and chained.output_text == "ok"
        redis_server.stop()
        try:
            with running_gateway(config) as third:
                client = openai.OpenAI(base_url=third.url + "/v1", api_key="-", max_retries=0)
                with pytest.raises(openai.InternalServerError) as caught:
                    client.responses.create(
                        model="fake", input="x", previous_response_id=chained.id
                    )
                assert caught.value.status_code == 503
                assert caught.value.code == "state_unavailable"
                # A turn that needs no stored state is served all the same.
                assert client.responses.create(model="fake", input="x").output_text == "ok"
                metrics = httpx.get(third.url + "/metrics").text
                assert 'kvturn_state_errors_total{op="get_response"} 1.0' in metrics
        finally:
            redis_server.start()


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


async def _events(stream: ResponsesStream) -> list[dict[str, Any]]:
    out = b""
    while (chunk := await stream.next_chunk()) is not None:
        out += chunk
        if stream.at_end:
            break
    await stream.aclose()
    return [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]


async def test_a_stream_that_breaks_off_ends_failed_and_is_not_stored() -> None:
    t = await translate({"model": "m", "input": "hi", "stream": True}, _empty(), "")
    done: list[dict[str, Any]] = []

    async def on_done(response: dict[str, Any]) -> None:
        done.append(response)

    delta = {"choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]}
    broke = {"error": {"message": "the decode engine's stream broke off", "code": "upstream_error"}}
    # Split mid-event: the translation must reassemble events across chunks.
    raw = _sse(delta) + _sse(broke)
    inner = ChunkStream(raw[:17], raw[17:])
    events = await _events(ResponsesStream(inner, t, 0, on_done))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent).validate_python(event)
    assert done == [] and inner.closed == 1


async def test_a_stream_cut_at_max_tokens_is_incomplete_and_stored() -> None:
    t = await translate({"model": "m", "input": "hi", "stream": True}, _empty(), "")
    done: list[dict[str, Any]] = []

    async def on_done(response: dict[str, Any]) -> None:
        done.append(response)

    chunks = (
        _sse(
            {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
        )
        + b"data: [DONE]\n\n"
    )
    events = await _events(ResponsesStream(ChunkStream(chunks), t, 4, on_done))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["content"][0]["text"] == "abc"
    assert final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 4
    events_type = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for event in events:  # each as the SDK's types define it, strictly
        events_type.validate_python(event)
    assert done == [final["response"]]


@pytest.mark.parametrize("tools", [False, True])
def test_response_objects_validate_strictly_against_the_sdks_types(
    gateway: str, tools: bool
) -> None:
    """The SDK parses leniently; its pydantic types, validated strictly, catch a missing field."""
    body: dict[str, Any] = {"model": "fake", "input": "hi", "metadata": {"k": "v"}}
    if tools:
        body |= {"tools": [TOOL], "tool_choice": {"type": "function", "name": "lookup"}}
    answer = httpx.post(gateway + "/v1/responses", json=body)
    assert answer.status_code == 200
    response = openai.types.responses.Response.model_validate(answer.json())
    assert response.metadata == {"k": "v"}
    assert [item.type for item in response.output] == (["function_call"] if tools else ["message"])
    fetched = httpx.get(f"{gateway}/v1/responses/{response.id}")
    openai.types.responses.Response.model_validate(fetched.json())
