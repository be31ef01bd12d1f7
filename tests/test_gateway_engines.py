"""The gateway on real engines, driven by the official openai client."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.engines import EngineProcess, EngineSpec, KVSettings, wait_until_healthy
from tests.conftest import TEST_BASE_PORT, TEST_KV_TTL_S, LocalPair
from tests.engine_requests import long_prompt
from tests.gateway_fixtures import free_port, metric, run_turn, running_gateway

pytestmark = pytest.mark.engines


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


def _opening(topic: str, tokens: int = 1500) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful agent that uses tools."},
        {"role": "user", "content": long_prompt(tokens, topic)},
    ]


def _tool_result(turn: int) -> dict[str, str]:
    return {"role": "tool", "content": f"result {turn}: " + "the sensor reads 42. " * 12}


def _pair_config(pair: LocalPair, **overrides: object) -> GatewayConfig:
    return GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints([pair.decode_url], [pair.decode_control_url]),
        **overrides,  # type: ignore[arg-type]
    )


def test_streamed_conversation_reuses_previous_context(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    gateway_metrics = local_pair.gateway_url.removesuffix("/v1") + "/metrics"
    reused_before = metric(gateway_metrics, "kvturn_reused_tokens_total")
    pulls_before = metric(f"{local_pair.prefill_url}/metrics", "vllm:nixl_xfer_time_seconds_count")
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _opening("river deltas")
    previous_context = 0
    header_total = 0
    for turn in range(4):
        got = run_turn(client, local_pair.model, messages, conversation)
        replay = run_turn(client, local_pair.model, messages)  # no conversation id: recompute
        assert replay.plan == "recompute"
        assert got.text == replay.text, f"turn {turn}: reuse changed the answer"
        if turn == 0:
            assert got.plan == "recompute"
        else:
            assert got.plan == "pull-reuse", f"turn {turn}"
            assert got.reused_tokens >= 0.9 * previous_context, (turn, got.reused_tokens)
            assert got.reused_tokens < got.prompt_tokens
        header_total += got.reused_tokens
        previous_context = got.prompt_tokens + got.completion_tokens
        messages = [*messages, {"role": "assistant", "content": got.text}, _tool_result(turn)]

    assert metric(gateway_metrics, "kvturn_reused_tokens_total") - reused_before == header_total
    # Prefill really pulled over NIXL, once per reusing turn (stats land on a logging tick).
    deadline = time.monotonic() + 15
    while True:
        pulls = metric(f"{local_pair.prefill_url}/metrics", "vllm:nixl_xfer_time_seconds_count")
        if pulls - pulls_before >= 3 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert pulls - pulls_before >= 3


def test_non_streamed_turns_reuse_too(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _opening("glaciers", 800)
    first = run_turn(client, local_pair.model, messages, conversation, stream=False)
    messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
    second = run_turn(client, local_pair.model, messages, conversation, stream=False)
    assert second.plan == "pull-reuse"
    assert second.reused_tokens >= 0.9 * (first.prompt_tokens + first.completion_tokens)
    assert second.text == run_turn(client, local_pair.model, messages, stream=False).text


def test_edited_history_reuses_only_the_common_prefix(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _opening("volcanoes", 1200)
    for turn in range(2):
        got = run_turn(client, local_pair.model, messages, conversation)
        messages = [*messages, {"role": "assistant", "content": got.text}, _tool_result(turn)]
    # The agent drops a middle message (the first tool result) before turn 3.
    edited = [m for i, m in enumerate(messages) if i != 3]
    got = run_turn(client, local_pair.model, edited, conversation)
    assert got.text == run_turn(client, local_pair.model, edited).text
    common = _common_prefix_tokens(local_pair, [*messages[:3], messages[3]], edited)
    assert 0 < got.reused_tokens <= common
    assert got.plan == "pull-reuse"


def _common_prefix_tokens(pair: LocalPair, a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    def ids(messages: list[dict[str, str]]) -> list[int]:
        body = {"model": pair.model, "messages": messages, "add_generation_prompt": False}
        return list(
            httpx.post(f"{pair.prefill_url}/tokenize", json=body, timeout=60).json()["tokens"]
        )

    x, y = ids(a), ids(b)
    pairs = enumerate(zip(x, y, strict=False))
    return next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))


def test_lapsed_lease_falls_back_to_recompute(local_pair: LocalPair) -> None:
    with running_gateway(_pair_config(local_pair, lease_s=1.0)) as gateway:
        client = _client(gateway.url + "/v1")
        messages = _opening("lighthouses", 600)
        first = run_turn(client, local_pair.model, messages, "lease-test")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        time.sleep(1.5)
        second = run_turn(client, local_pair.model, messages, "lease-test")
        assert second.plan == "recompute"
        assert second.reused_tokens == 0
        assert second.text == run_turn(client, local_pair.model, messages).text
        lapsed = metric(
            gateway.url + "/metrics", 'kvturn_reuse_fallbacks_total{reason="lease-expired"}'
        )
        assert lapsed == 1


def test_tool_call_round_trip(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    tools = [{
        "type": "function",
        "function": {
            "name": "read_sensor",
            "description": "Read a sensor by name.",
            "parameters": {"type": "object", "properties": {"name": {"enum": ["temp", "humidity"]}},
                           "required": ["name"]},
        },
    }]  # fmt: skip
    messages = _opening("sensors", 400)
    call = run_turn(
        client, local_pair.model, messages, "tools-test", stream=False, max_tokens=120,
        tools=tools, tool_choice={"type": "function", "function": {"name": "read_sensor"}},
    )  # fmt: skip
    assert call.tool_calls, "no tool call came back"
    tool_call = call.tool_calls[0]
    assert tool_call.function.name == "read_sensor"
    messages = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "42 degrees"},
    ]
    answer = run_turn(client, local_pair.model, messages, "tools-test", tools=tools)
    assert answer.plan == "pull-reuse"
    assert answer.text == run_turn(client, local_pair.model, messages, tools=tools).text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        # The gateway's own: it must read the body.
        (b"{not json", 400, None),
        (b"[]", 400, None),
        # The engine's, passed on unchanged (tests/test_differential.py compares more).
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404,
         "model"),
        (b'{"model": "tiny", "messages": []}', 400, None),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(
    local_pair: LocalPair, body: bytes, status: int, param: str | None
) -> None:
    url = local_pair.gateway_url + "/chat/completions"
    response = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] in ("invalid_request_error", "BadRequestError", "NotFoundError")
    assert error["param"] == param
    assert error["message"]


def test_invalid_conversation_id_and_engine_errors(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    with pytest.raises(openai.BadRequestError, match="conversation id"):
        run_turn(client, local_pair.model, _opening("x", 50), conversation_id="bad id!")
    # The engine's own 4xx comes back unchanged.
    with pytest.raises(openai.BadRequestError):
        run_turn(client, local_pair.model, _opening("x", 50), max_tokens=10**7)


def test_oversized_body_and_no_healthy_engine(local_pair: LocalPair) -> None:
    config = _pair_config(local_pair, max_body_bytes=10_000)
    with running_gateway(config) as gateway:
        big = {"model": local_pair.model, "messages": [{"role": "user", "content": "x" * 20_000}]}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=big)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    dead = GatewayConfig(
        prefill=endpoints([f"http://127.0.0.1:{free_port()}"]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        health_interval_s=0.2,
    )
    with running_gateway(dead) as gateway:
        time.sleep(0.6)
        body = {"model": local_pair.model, "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"
        assert httpx.get(gateway.url + "/health").status_code == 503


def test_completions_endpoint_goes_through_prefill_and_decode(local_pair: LocalPair) -> None:
    client = _client(local_pair.gateway_url)
    raw = client.completions.with_raw_response.create(
        model=local_pair.model, prompt=long_prompt(300, "kites"), max_tokens=12, temperature=0
    )
    assert raw.headers["x-kvturn-plan"] == "recompute"
    assert raw.parse().usage.completion_tokens == 12


def test_holder_decode_killed_between_turns_recomputes_elsewhere(
    local_pair: LocalPair, tmp_path: Path
) -> None:
    """A second decode engine holds turn 1, dies, and turn 2 still succeeds on the first."""
    spec = EngineSpec(
        role="decode",
        model=Path(str(local_pair.state["model_path"])),
        served_model_name=local_pair.model,
        port=TEST_BASE_PORT + 50,
        side_channel_port=TEST_BASE_PORT + 150,
        control_port=TEST_BASE_PORT + 250,
        cpu=0,
        kv=KVSettings(decoder_kv_blocks_ttl_s=TEST_KV_TTL_S),
    )
    extra = EngineProcess(spec, tmp_path / "extra-decode.log").start()
    try:
        wait_until_healthy([extra], timeout_s=900)
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            # The extra decode is listed first, so it wins the tie and holds turn 1.
            decode=endpoints(
                [spec.url, local_pair.decode_url],
                [f"http://127.0.0.1:{spec.control_port}", local_pair.decode_control_url],
            ),
            health_interval_s=0.5,
        )
        with running_gateway(config) as gateway:
            client = _client(gateway.url + "/v1")
            messages = _opening("meteors", 600)
            first = run_turn(client, local_pair.model, messages, "failover")
            store = gateway.app.state.gateway.store
            deadline = time.monotonic() + 5  # the location is recorded just after the reply
            while store.get("failover").holder_url is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store.get("failover").holder_url == spec.url
            extra.stop()
            messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
            second = run_turn(client, local_pair.model, messages, "failover")
            assert second.plan == "recompute"
            assert second.text == run_turn(client, local_pair.model, messages).text
    finally:
        extra.stop()


def test_failed_pull_is_retried_as_recompute(local_pair: LocalPair) -> None:
    """The KV lapses between the lookup and the pull: prefill declines, the turn still works."""
    with running_gateway(_pair_config(local_pair)) as gateway:
        client = _client(gateway.url + "/v1")
        runner = gateway.app.state.gateway.runner
        messages = _opening("harbours", 600)
        first = run_turn(client, local_pair.model, messages, "lapsing")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        real_lookup = runner._fetch_retained

        async def lapsed_lookup(holder: str | None, rid: str | None) -> dict[str, Any] | None:
            params = await real_lookup(holder, rid)
            assert params is not None, "turn 1's KV should still be retained"
            # Decode's deadline, on its perf_counter clock (the same machine, the same clock).
            params["remote_blocks_expiry_time"] = time.perf_counter() - 1
            return params

        runner._fetch_retained = lapsed_lookup
        second = run_turn(client, local_pair.model, messages, "lapsing")
        assert second.plan == "recompute"
        assert second.reused_tokens == 0
        assert second.text == run_turn(client, local_pair.model, messages).text
        # Prefill either failed the request (the gateway retried it as a recompute) or
        # declined the read and computed the prompt itself: either way nothing was reused.
        metrics = gateway.url + "/metrics"
        failed = metric(metrics, 'kvturn_reuse_fallbacks_total{reason="pull-failed"}')
        declined = metric(metrics, 'kvturn_reuse_fallbacks_total{reason="no-common-prefix"}')
        assert failed + declined == 1
        # Prefill is not left stuck: it still serves promptly.
        started = time.monotonic()
        run_turn(client, local_pair.model, _opening("kelp", 300))
        assert time.monotonic() - started < 30


def test_retained_kv_is_single_use(local_pair: LocalPair) -> None:
    """Once prefill has read a decode's retained blocks, decode frees them and stops
    advertising them, and the gateway never hands the same blocks to two turns."""
    with running_gateway(_pair_config(local_pair)) as gateway:
        client = _client(gateway.url + "/v1")
        store = gateway.app.state.gateway.store
        messages = _opening("estuaries", 600)
        first = run_turn(client, local_pair.model, messages, "once")
        deadline = time.monotonic() + 5
        while store.get("once").holder_request_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        consumed = store.get("once").holder_request_id
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        assert run_turn(client, local_pair.model, messages, "once").plan == "pull-reuse"
        url = f"{local_pair.decode_control_url}/kvturn/retained/{consumed}"
        deadline = time.monotonic() + 5
        while httpx.get(url).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(url).status_code == 404
