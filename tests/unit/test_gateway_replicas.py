"""Several gateways sharing one conversation table in a real Redis, on a fake engine.

Reuse on real engines across replicas is ``tests/test_gateway_replicas_engines.py``; here the
table's behaviour through HTTP: whichever replica serves a turn finds the previous one's KV,
parallel turns never both pull it, heartbeats and releases work from any replica, and a Redis
outage costs reuse, never a request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvturn import control
from kvturn.gateway.config import GatewayConfig, endpoints
from tests import fake_engine
from tests.gateway_fixtures import (
    RedisServer,
    running_fake_engine,
    running_gateway,
    running_redis,
)


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture
def replicas(fake_url: str, redis_server: RedisServer) -> Iterator[list[str]]:
    """Two replicas on one table; the same messages again reuse by a pull."""
    with _pair(fake_url, redis_server, decode_local=False) as pair:
        yield pair


@pytest.fixture
def local_replicas(fake_url: str, redis_server: RedisServer) -> Iterator[list[str]]:
    """Two replicas on one table, with decode-local turns (the default)."""
    with _pair(fake_url, redis_server) as pair:
        yield pair


@contextlib.contextmanager
def _pair(fake_url: str, redis_server: RedisServer, **settings: Any) -> Iterator[list[str]]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        state=redis_server.url,
        **settings,
    )
    with running_gateway(config) as a, running_gateway(config) as b:
        yield [a.url, b.url]


#: Long enough that a turn's KV is worth reusing (the fake engine counts a token a byte).
MESSAGES = [
    {"role": "user", "content": "Read the repository and list the modules that import the wire."}
]


def _chat(url: str, messages: list[dict[str, Any]] | None = None, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": "fake", "messages": messages or MESSAGES, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _plan(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    return response.headers["x-kvturn-plan"], response.headers["x-kvturn-plan-reason"]


def test_turns_alternating_between_replicas_reuse(replicas: list[str]) -> None:
    cid = {"X-Conversation-Id": "alternating"}
    plans = [_plan(_chat(replicas[i % 2], headers=cid, stream=i % 2 == 1)) for i in range(4)]
    assert plans[0] == ("recompute", "first-turn")
    assert [p for p, _ in plans[1:]] == ["pull-reuse"] * 3


def test_a_conversation_without_an_id_is_found_on_the_other_replica(
    local_replicas: list[str],
) -> None:
    replicas = local_replicas
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Plan my week: three meetings, two reviews, one trip."}
    ]
    first = _chat(replicas[0], messages)
    assert _plan(first)[0] == "recompute"
    reply = first.json()["choices"][0]["message"]
    messages += [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "And Friday?"},
    ]
    second = _chat(replicas[1], messages)
    # It extends turn 1: the holder continues it, planned by a bound on its new tokens.
    assert _plan(second)[0] == "decode-local"
    assert second.headers["x-conversation-id"] == first.headers["x-conversation-id"]


def test_parallel_turns_on_two_replicas_never_pull_the_same_kv(replicas: list[str]) -> None:
    cid = {"X-Conversation-Id": "parallel"}
    assert _plan(_chat(replicas[0], headers=cid))[0] == "recompute"
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_chat, url, headers=cid, fake_delay_ms=100) for url in replicas]
            plans = sorted(_plan(f.result())[0] for f in futures)
        # One took the KV; the other found it gone. Both answered.
        assert plans == ["pull-reuse", "recompute"], plans


def test_heartbeats_and_releases_reach_the_table_from_any_replica(replicas: list[str]) -> None:
    cid = {"X-Conversation-Id": "beats"}
    _plan(_chat(replicas[0], headers=cid))
    beat = httpx.post(
        replicas[1] + "/v1" + control.heartbeat_path("beats"),
        json={"pause_kind": "tool", "paused_ms": 5},
    )
    answer = control.HeartbeatResponse.model_validate_json(beat.content)
    assert answer.known and answer.lease_remaining_s > 0
    releases = fake_engine.COUNTS.get("releases", 0)
    released = httpx.delete(replicas[1] + "/v1" + control.release_path("beats"))
    assert control.ReleaseResponse.model_validate_json(released.content).released
    assert fake_engine.COUNTS.get("releases", 0) == releases + 1  # freed on the holder
    assert _plan(_chat(replicas[0], headers=cid)) == ("recompute", "first-turn")


def test_a_redis_outage_costs_reuse_never_a_request(
    replicas: list[str], redis_server: RedisServer
) -> None:
    cid = {"X-Conversation-Id": "outage"}
    assert _plan(_chat(replicas[0], headers=cid))[0] == "recompute"
    assert _plan(_chat(replicas[1], headers=cid))[0] == "pull-reuse"
    redis_server.stop()
    try:
        for i in range(3):
            response = _chat(replicas[i % 2], headers=cid, stream=i == 1)
            assert _plan(response) == ("recompute", "state-unavailable")
            assert "data: [DONE]" in response.text or response.json()["choices"]
        # Without an id as well.
        assert _plan(_chat(replicas[0]))[1] == "state-unavailable"
        beat = httpx.post(replicas[0] + "/v1" + control.heartbeat_path("outage"), json={})
        assert beat.status_code == 503
        assert beat.json()["error"]["code"] == "state_unavailable"
        metrics = httpx.get(replicas[0] + "/metrics").text
        assert 'kvturn_state_errors_total{op="take"}' in metrics
    finally:
        redis_server.start()
    # Redis is back (empty: it kept nothing): the next turn records, the one after reuses.
    assert _plan(_chat(replicas[1], headers=cid)) == ("recompute", "first-turn")
    assert _plan(_chat(replicas[0], headers=cid))[0] == "pull-reuse"


def test_a_gateway_restart_keeps_reuse(fake_url: str, redis_server: RedisServer) -> None:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        state=redis_server.url,
        decode_local=False,  # the same messages again reuse by a pull
    )
    cid = {"X-Conversation-Id": "restart"}
    with running_gateway(config) as first:
        assert _plan(_chat(first.url, headers=cid))[0] == "recompute"
    with running_gateway(config) as second:
        assert _plan(_chat(second.url, headers=cid))[0] == "pull-reuse"
