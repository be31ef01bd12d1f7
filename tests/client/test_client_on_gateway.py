"""kvturn.client against the real kvturn gateway (on the fast fake engine): the gateway sees the
conversation, the pauses, the heartbeats and the release. Sync and async."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvturn.client import AsyncOpenAI, OpenAI
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests.gateway_fixtures import metric, running_fake_engine, running_gateway

#: Long enough that a turn's KV is worth reusing (the fake engine counts a token a byte).
MESSAGES = [
    {"role": "user", "content": "Read the repository and list the modules that import the wire."}
]
#: A short lease so that a pause of a second already needs heartbeats (first at half the lease).
LEASE_S = 0.4


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayThread]:
    with running_fake_engine() as fake:
        config = GatewayConfig(
            prefill=endpoints([fake]),
            decode=endpoints([fake], [fake]),
            lease_s=LEASE_S,
            expiry_margin_s=0.05,
            decode_local=False,  # the same messages again reuse by a pull
        )
        with running_gateway(config) as running:
            yield running


def _metrics(gateway: GatewayThread, name: str) -> float:
    return metric(gateway.url + "/metrics", name)


def test_sync_conversation_is_seen_by_the_gateway(gateway: GatewayThread) -> None:
    client = OpenAI(base_url=gateway.url + "/v1", api_key="-")
    store = gateway.app.state.gateway.store
    beats, releases = (
        _metrics(gateway, "kvturn_heartbeats_total"),
        _metrics(gateway, "kvturn_releases_total"),
    )
    pauses = _metrics(gateway, 'kvturn_client_pause_seconds_count{kind="user"}')
    with client.conversation("sync-conv") as conversation:
        client.chat.completions.create(model="fake", messages=MESSAGES)
        assert store.get(scoped_key("", "sync-conv")) is not None
        assert conversation.lease_seconds == LEASE_S  # learned from the gateway's header
        time.sleep(1.0)  # a long pause: heartbeats renew the lease through the gateway
        assert _metrics(gateway, "kvturn_heartbeats_total") - beats >= 1
        second = client.chat.completions.with_raw_response.create(model="fake", messages=MESSAGES)
        assert second.headers["x-kvturn-plan"] == "pull-reuse"
    assert _metrics(gateway, 'kvturn_client_pause_seconds_count{kind="user"}') - pauses == 1
    assert _metrics(gateway, "kvturn_releases_total") - releases == 1
    assert store.get(scoped_key("", "sync-conv")) is None
    client.close()


def test_short_pauses_send_no_heartbeats(gateway: GatewayThread) -> None:
    client = OpenAI(base_url=gateway.url + "/v1", api_key="-")
    beats = _metrics(gateway, "kvturn_heartbeats_total")
    with client.conversation("quick-conv"):
        client.chat.completions.create(model="fake", messages=MESSAGES)
        time.sleep(0.05)
        client.chat.completions.create(model="fake", messages=MESSAGES)
    assert _metrics(gateway, "kvturn_heartbeats_total") == beats
    client.close()


def test_async_conversation_is_seen_by_the_gateway(gateway: GatewayThread) -> None:
    async def run() -> None:
        client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="-")
        store = gateway.app.state.gateway.store
        beats = _metrics(gateway, "kvturn_heartbeats_total")
        releases = _metrics(gateway, "kvturn_releases_total")
        async with client.conversation("async-conv"):
            stream = await client.chat.completions.create(
                model="fake", messages=MESSAGES, stream=True
            )
            async for _ in stream:
                pass
            assert store.get(scoped_key("", "async-conv")) is not None
            await asyncio.sleep(1.0)
            assert _metrics(gateway, "kvturn_heartbeats_total") - beats >= 1
        assert _metrics(gateway, "kvturn_releases_total") - releases == 1
        assert store.get(scoped_key("", "async-conv")) is None
        await client.close()

    asyncio.run(run())


def test_turn_id_survives_the_sdk_retry(gateway: GatewayThread) -> None:
    """The engine throttles the first attempt (429, passed through); the SDK retries with the
    same turn id, and the gateway recognises the retry of the same turn."""
    client = OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=2)
    store = gateway.app.state.gateway.store
    retries = _metrics(gateway, "kvturn_turn_retries_total")
    with client.conversation("retry-conv") as conversation:
        client.chat.completions.create(
            model="fake", messages=MESSAGES, extra_body={"fake_429_once": "retry-conv-1"}
        )
        turn = conversation.last_turn
        assert turn is not None
        assert store.get(scoped_key("", "retry-conv")).last_turn_id == turn.turn_id
        assert store.get(scoped_key("", "retry-conv")).retries == 1
        client.chat.completions.create(model="fake", messages=MESSAGES)
        assert store.get(scoped_key("", "retry-conv")).retries == 1  # a new turn is not a retry
    assert _metrics(gateway, "kvturn_turn_retries_total") - retries == 1
    client.close()


def test_responses_api_inside_a_conversation(gateway: GatewayThread) -> None:
    """``client.responses.create`` inside a conversation: the gateway sees the conversation,
    a function call in the reply makes the pause after it a tool pause, heartbeats renew the
    lease through it, and leaving releases it."""
    client = OpenAI(base_url=gateway.url + "/v1", api_key="-")
    store = gateway.app.state.gateway.store
    beats = _metrics(gateway, "kvturn_heartbeats_total")
    tool_pauses = _metrics(gateway, 'kvturn_client_pause_seconds_count{kind="tool"}')
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    with client.conversation("responses-conv") as conversation:
        asked = client.responses.create(
            model="fake",
            input="look it up in the repository, every module that imports the wire",
            tools=[tool],
            tool_choice={"type": "function", "name": "lookup"},
        )
        assert asked.output[0].type == "function_call"
        assert store.get(scoped_key("", "responses-conv")) is not None
        assert conversation.lease_seconds == LEASE_S
        time.sleep(1.0)  # the tool "runs": heartbeats keep the lease
        assert _metrics(gateway, "kvturn_heartbeats_total") - beats >= 1
        with client.responses.stream(
            model="fake",
            previous_response_id=asked.id,
            tools=[tool],  # the same tools: its prompt extends the first (else nothing to reuse)
            input=[{"type": "function_call_output", "call_id": "call_fake1", "output": "42"}],
        ) as events:
            for _ in events:
                pass
            assert events.get_final_response().output_text == "ok"
        assert [turn.plan for turn in conversation.turns] == ["recompute", "pull-reuse"]
    assert _metrics(gateway, 'kvturn_client_pause_seconds_count{kind="tool"}') - tool_pauses == 1
    assert store.get(scoped_key("", "responses-conv")) is None
    client.close()
