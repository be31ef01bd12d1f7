"""Faults on real engines: an engine killed or restarted, the gateway restarted. For each: no
hang, no 5xx where another engine could serve, and the next turn's answer equals one engine
alone. (A holder dying during the pull and a pull declined after expiry are in
``test_gateway_engines.py``; a lease lapsing mid-pull in ``test_leases_engines.py``.)

Extra engines start one at a time beside the session's pair (three engines at most)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.digests import message_digests, seed
from kvturn.gateway.ops.launch.engines import (
    EngineProcess,
    EngineSpec,
    KVSettings,
    wait_until_healthy,
)
from tests.conftest import TEST_BASE_PORT, TEST_KV_TTL_S, LocalPair
from tests.engine_requests import long_prompt, single_engine_ids
from tests.gateway_fixtures import (
    TurnResult,
    metric,
    run_turn,
    running_gateway,
    wait_recorded,
)

pytestmark = pytest.mark.engines

MAX_TOKENS = 16
#: Every faulted turn must end within this (a hang fails the test, not the session).
TURN_BOUND_S = 240


#: Leases on the extra decode outlive its restart (a minute or two here), so that the turn after
#: it really asks the new engine for the lease rather than seeing it lapsed on the gateway.
LONG_LEASE_S = 900
#: The extra prefill's own API key (vLLM's ``--api-key``).
ENGINE_KEY = "engine-key-0123456789"


def _spec(pair: LocalPair, role: str, offset: int, *extra_args: str) -> EngineSpec:
    return EngineSpec(
        role=role,  # type: ignore[arg-type]
        model=Path(str(pair.state["model_path"])),
        served_model_name=pair.model,
        port=TEST_BASE_PORT + offset,
        side_channel_port=TEST_BASE_PORT + 100 + offset,
        control_port=TEST_BASE_PORT + 200 + offset if role == "decode" else 0,
        cpu=0,
        kv=KVSettings(decoder_kv_blocks_ttl_s=LONG_LEASE_S if role == "decode" else TEST_KV_TTL_S),
        prefix_caching=role == "decode",
        extra_args=extra_args,
    )


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=TURN_BOUND_S)


def _history(topic: str, tokens: int = 600) -> list[dict[str, Any]]:
    return [{"role": "user", "content": long_prompt(tokens, topic)}]


def _history_placed_on(
    gateway: Any, url: str, model: str, topic: str, tokens: int
) -> list[dict[str, Any]]:
    """A history whose P/D turns the gateway places on prefill ``url``: it places a chat turn by
    rendezvous hash of its first messages' digest (``turns.placement.choose_prefill``), so the topic
    is varied until that digest lands there."""
    pool = gateway.app.state.gateway.prefill
    for n in range(64):
        messages = _history(f"{topic} {n}", tokens)
        if pool.affine(message_digests(seed("", model, None), messages)[0]) == url:
            return messages
    raise AssertionError(f"no history of 64 is placed on {url}")


def _next(messages: list[dict[str, Any]], reply: TurnResult, turn: int) -> list[dict[str, Any]]:
    tool = {"role": "tool", "content": f"result {turn}: " + "the gauge reads 7. " * 12}
    return [*messages, {"role": "assistant", "content": reply.text}, tool]


def _assert_same_answer(pair: LocalPair, got: TurnResult, messages: list[dict[str, Any]]) -> None:
    want = single_engine_ids(pair.prefill_url, pair.model, messages, MAX_TOKENS)
    assert got.token_ids == want, "the answer after the fault differs from one engine alone"


def _fallbacks(gateway: Any) -> dict[str, float]:
    """The gateway's recompute reasons past the first turn, with their counts."""
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    found = re.findall(r'^kvturn_reuse_fallbacks_total\{reason="([^"]+)"\} (\S+)$', text, re.M)
    return {reason: float(n) for reason, n in found if reason != "first-turn"}


@pytest.fixture(scope="module")
def extra_decode(local_pair: LocalPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A second decode (listed first, so new conversations land on it), restartable."""
    logs = tmp_path_factory.mktemp("fault-matrix")
    spec = _spec(local_pair, "decode", 70)
    engine = EngineProcess(spec, logs / "decode-1.log").start()
    handle = {"engine": engine, "spec": spec, "logs": logs}
    try:
        wait_until_healthy([engine], timeout_s=900)
        yield handle
    finally:
        handle["engine"].stop()


def _two_decode_config(pair: LocalPair, extra: EngineSpec) -> GatewayConfig:
    return GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints(
            [extra.url, pair.decode_url],
            [f"http://127.0.0.1:{extra.control_port}", pair.decode_control_url],
        ),
        control_secret=pair.control_secret,
        decode_local=False,  # these tests prove the pull path
        health_interval_s=3600,  # only the gateway's own failures tell it an engine died
        lease_s=LONG_LEASE_S,
    )


def test_holder_decode_restarted_between_turns_reads_no_stale_kv(
    local_pair: LocalPair, extra_decode: dict[str, Any]
) -> None:
    """Turn 1 leaves its KV on a decode that is then restarted (a new engine, same URL and
    ports). Turn 2 finds no lease there (the new connector never granted it), recomputes, and
    answers as one engine alone: nothing of the old engine's blocks is read."""
    spec: EngineSpec = extra_decode["spec"]
    with running_gateway(_two_decode_config(local_pair, spec)) as gateway:
        client = _client(gateway.url)
        messages = _history("old lighthouses")
        first = run_turn(client, local_pair.model, messages, "restarted-holder")
        assert wait_recorded(gateway, "restarted-holder").holder_url == spec.url

        extra_decode["engine"].stop()
        engine = EngineProcess(spec, extra_decode["logs"] / "decode-2.log").start()
        extra_decode["engine"] = engine
        wait_until_healthy([engine], timeout_s=900)

        messages = _next(messages, first, 0)
        started = time.monotonic()
        second = run_turn(client, local_pair.model, messages, "restarted-holder")
        assert time.monotonic() - started < TURN_BOUND_S
        assert (second.plan, second.reused_tokens) == ("recompute", 0)
        _assert_same_answer(local_pair, second, messages)
        assert _fallbacks(gateway) == {"kv-gone": 1}


def test_decode_killed_mid_stream_then_the_next_turn_recomputes_on_a_live_decode(
    local_pair: LocalPair, extra_decode: dict[str, Any]
) -> None:
    """The decode streaming a reply is killed mid-way: the client's stream ends with an
    OpenAI error event (no hang); the conversation's next turn recomputes on the live decode
    and answers as one engine alone."""
    spec: EngineSpec = extra_decode["spec"]
    with running_gateway(_two_decode_config(local_pair, spec)) as gateway:
        client = _client(gateway.url)
        messages = _history("storm drains")
        first = run_turn(client, local_pair.model, messages, "killed-mid-stream")
        assert wait_recorded(gateway, "killed-mid-stream").holder_url == spec.url
        messages = _next(messages, first, 0)

        stream = client.chat.completions.create(
            model=local_pair.model, messages=messages, stream=True, temperature=0,
            max_tokens=2000, extra_body={"ignore_eos": True},
            extra_headers={"X-Conversation-Id": "killed-mid-stream"},
        )  # fmt: skip
        received = 0
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="broke off"):
            for _chunk in stream:
                received += 1
                if received == 3:
                    extra_decode["engine"].stop(grace_s=0)  # SIGTERM, then SIGKILL at once
        assert time.monotonic() - started < TURN_BOUND_S
        assert received >= 3

        third = run_turn(client, local_pair.model, messages, "killed-mid-stream")
        assert third.plan == "recompute"
        _assert_same_answer(local_pair, third, messages)
        assert wait_recorded(gateway, "killed-mid-stream").holder_url == local_pair.decode_url


def test_prefill_killed_during_a_turn_is_served_by_another_prefill(
    local_pair: LocalPair, extra_decode: dict[str, Any], tmp_path: Path
) -> None:
    """A prefill engine dies while it computes a turn's prompt: the gateway serves the turn on
    the other prefill (200, the same answer as one engine alone), and marks the dead one.

    The extra prefill requires an API key (vLLM's ``--api-key``): the gateway presents it."""
    extra_decode["engine"].stop()  # three engines at most: the extra decode is done
    spec = _spec(local_pair, "prefill", 80, "--api-key", ENGINE_KEY)
    engine = EngineProcess(spec, tmp_path / "prefill.log").start()
    try:
        wait_until_healthy([engine], timeout_s=900)
        plain = {"model": local_pair.model, "messages": _history("keys", 50), "max_tokens": 2}
        assert httpx.post(f"{spec.url}/v1/chat/completions", json=plain).status_code == 401
        config = GatewayConfig(
            prefill=endpoints([spec.url, local_pair.prefill_url]),  # the extra one first
            decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
            control_secret=local_pair.control_secret,
            decode_local=False,  # these tests prove the pull path
            health_interval_s=3600,
            engine_api_key=ENGINE_KEY,
        )
        with running_gateway(config) as gateway:
            # Served by the extra prefill, which accepts the gateway's key.
            before = metric(f"{spec.url}/metrics", "vllm:prompt_tokens_total")
            keys = _history_placed_on(gateway, spec.url, local_pair.model, "keys", 50)
            run_turn(_client(gateway.url), local_pair.model, keys)
            assert metric(f"{spec.url}/metrics", "vllm:prompt_tokens_total") > before
            upstream = gateway.app.state.gateway.upstream
            real_post = upstream.post_json
            killed = []

            async def post_then_kill(url: str, body: Any, headers: Any = None) -> Any:
                if not url.startswith(spec.url):
                    return await real_post(url, body, headers)
                request = asyncio.ensure_future(real_post(url, body, headers))
                await asyncio.sleep(0.3)  # the prompt takes prefill about a second
                await asyncio.get_running_loop().run_in_executor(None, engine.stop, 0)
                killed.append(url)
                return await request

            upstream.post_json = post_then_kill
            messages = _history_placed_on(gateway, spec.url, local_pair.model, "salt marshes", 8000)
            started = time.monotonic()
            got = run_turn(_client(gateway.url), local_pair.model, messages, "prefill-dies")
            assert time.monotonic() - started < TURN_BOUND_S
            assert killed, "the turn never reached the extra prefill"
            _assert_same_answer(local_pair, got, messages)
            health = {i.url: i.healthy for i in gateway.app.state.gateway.prefill.instances}
            assert health == {spec.url: False, local_pair.prefill_url: True}
    finally:
        engine.stop()


def test_gateway_restarted_between_turns(local_pair: LocalPair) -> None:
    """A new gateway knows nothing of the old one's conversations (its table is in memory):
    the next turn recomputes, correctly, and a heartbeat says the conversation is unknown."""
    config = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        control_secret=local_pair.control_secret,
    )
    messages = _history("tidal mills")
    with running_gateway(config) as gateway:
        first = run_turn(_client(gateway.url), local_pair.model, messages, "gateway-restart")
        wait_recorded(gateway, "gateway-restart")
    messages = _next(messages, first, 0)
    with running_gateway(config) as gateway:
        beat = httpx.post(gateway.url + "/v1/kvturn/conversations/gateway-restart/heartbeat")
        assert beat.json()["known"] is False
        second = run_turn(_client(gateway.url), local_pair.model, messages, "gateway-restart")
        assert second.plan == "recompute"
        _assert_same_answer(local_pair, second, messages)
