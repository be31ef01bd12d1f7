"""The gateway on real engines, driven by the official openai client.

A reusing turn is checked three ways, never by the gateway's word alone:

- its answer, as token ids, equals one engine alone with a fresh cache salt (nothing of the
  gateway's path, no pulled KV and no prefix cache another request filled, can touch that);
- prefill really read the history over NIXL: its transfer count and bytes rose;
- what the gateway says (plan header, reused tokens, metrics) agrees with both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn import control
from kvturn.gateway.auth import ApiKeys
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.launch.engines import EngineProcess, wait_until_healthy
from kvturn.gateway.server import GatewayThread
from tests.conftest import LocalPair
from tests.engine_requests import (
    KV_BYTES_PER_TOKEN,
    NixlReads,
    extra_decode_spec,
    kv_usage,
    long_prompt,
    single_engine_completion_ids,
    single_engine_ids,
)
from tests.gateway_fixtures import (
    TurnResult,
    free_port,
    metric,
    run_turn,
    running_gateway,
    wait_recorded,
)

pytestmark = pytest.mark.engines

MAX_TOKENS = 16


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


def _opening(topic: str, tokens: int = 1500) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful agent that uses tools."},
        {"role": "user", "content": long_prompt(tokens, topic)},
    ]


def _tool_result(turn: int) -> dict[str, str]:
    return {"role": "tool", "content": f"result {turn}: " + "the sensor reads 42. " * 12}


def _pair_config(pair: LocalPair, **overrides: object) -> GatewayConfig:
    """A gateway on the session pair that reuses by pulling: this module proves the pull path
    (NIXL reads, leases, fallbacks); ``test_planner_engines`` proves ``decode-local``."""
    overrides.setdefault("decode_local", False)
    return GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints([pair.decode_url], [pair.decode_control_url]),
        control_secret=pair.control_secret,
        **overrides,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def pull_url(local_pair: LocalPair) -> Iterator[str]:
    """The OpenAI base URL of a gateway on the session pair that reuses by pulling."""
    with running_gateway(_pair_config(local_pair)) as gateway:
        yield gateway.url + "/v1"


def _assert_same_answer(
    pair: LocalPair, got: TurnResult, messages: list[dict[str, Any]], **extra: Any
) -> None:
    """``got`` answers as one engine alone does (greedy, by token ids)."""
    want = single_engine_ids(pair.prefill_url, pair.model, messages, MAX_TOKENS, **extra)
    pairs = enumerate(zip(got.token_ids, want, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), None)
    assert got.token_ids == want, f"reuse changed the answer (first divergence at {first})"


@contextmanager
def _shifted_clock(gateway: GatewayThread) -> Iterator[Callable[[float], None]]:
    """The gateway's conversation clock, moved forward on demand (no sleeping on leases)."""
    store = gateway.app.state.gateway.store
    real, offset = store.clock, [0.0]
    store.clock = lambda: real() + offset[0]
    try:
        yield lambda seconds: offset.__setitem__(0, offset[0] + seconds)
    finally:
        store.clock = real


def _fallbacks(url: str, reason: str) -> float:
    return metric(url + "/metrics", f'kvturn_reuse_fallbacks_total{{reason="{reason}"}}')


def test_streamed_conversation_reuses_previous_context(
    local_pair: LocalPair, pull_url: str
) -> None:
    client = _client(pull_url)
    gateway_metrics = pull_url.removesuffix("/v1") + "/metrics"

    def counters() -> dict[str, float]:
        return {
            name: metric(gateway_metrics, name)
            for name in (
                "kvturn_reused_tokens_total",
                "kvturn_recomputed_tokens_total",
                'kvturn_ttft_seconds_count{plan="pull-reuse"}',
                'kvturn_turns_total{plan="pull-reuse"}',
            )
        }

    before = counters()
    reads = NixlReads(local_pair.prefill_url)
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _opening("river deltas")
    previous_context = reused_total = recomputed_total = 0
    for turn in range(4):
        got = run_turn(client, local_pair.model, messages, conversation)
        _assert_same_answer(local_pair, got, messages)
        if turn == 0:
            assert got.plan == "recompute"
        else:
            assert got.plan == "pull-reuse", f"turn {turn}"
            assert got.reused_tokens >= 0.9 * previous_context, (turn, got.reused_tokens)
            assert got.reused_tokens < got.prompt_tokens
        reused_total += got.reused_tokens
        recomputed_total += got.prompt_tokens - got.reused_tokens
        previous_context = got.prompt_tokens + got.completion_tokens
        messages = [*messages, {"role": "assistant", "content": got.text}, _tool_result(turn)]

    # Prefill read the reused history over NIXL, once per reusing turn, all of it.
    reads.wait_for(3, min_bytes=reused_total * KV_BYTES_PER_TOKEN)
    after = counters()
    assert after["kvturn_reused_tokens_total"] - before["kvturn_reused_tokens_total"] == (
        reused_total
    )
    assert after["kvturn_recomputed_tokens_total"] - before["kvturn_recomputed_tokens_total"] == (
        recomputed_total
    )
    reusing = (
        'kvturn_ttft_seconds_count{plan="pull-reuse"}',
        'kvturn_turns_total{plan="pull-reuse"}',
    )
    for name in reusing:
        assert after[name] - before[name] == 3, name


def test_non_streamed_turns_reuse_too(local_pair: LocalPair, pull_url: str) -> None:
    client = _client(pull_url)
    reads = NixlReads(local_pair.prefill_url)
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _opening("glaciers", 800)
    first = run_turn(client, local_pair.model, messages, conversation, stream=False)
    messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
    second = run_turn(client, local_pair.model, messages, conversation, stream=False)
    assert second.plan == "pull-reuse"
    assert second.reused_tokens >= 0.9 * (first.prompt_tokens + first.completion_tokens)
    _assert_same_answer(local_pair, second, messages)
    reads.wait_for(1, min_bytes=second.reused_tokens * KV_BYTES_PER_TOKEN)


def test_tenants_reuse_their_own_kv_and_never_anothers(local_pair: LocalPair) -> None:
    """With API keys, each tenant's turns carry its own cache salt: a tenant's second turn still
    pulls its history (the salt is the same on both ends of the transfer), the answer is
    unchanged, and another tenant using the same conversation id gets none of it."""
    keys = ApiKeys([("sk-alpha-0123456789abcdef", "alpha"), ("sk-beta-0123456789abcdef", "beta")])
    with running_gateway(_pair_config(local_pair, api_keys=keys)) as gateway:
        alpha = openai.OpenAI(
            base_url=gateway.url + "/v1", api_key="sk-alpha-0123456789abcdef", max_retries=0
        )
        beta = openai.OpenAI(
            base_url=gateway.url + "/v1", api_key="sk-beta-0123456789abcdef", max_retries=0
        )
        conversation = f"shared-{uuid.uuid4().hex[:8]}"
        reads = NixlReads(local_pair.prefill_url)
        messages = _opening("tide pools", 800)
        first = run_turn(alpha, local_pair.model, messages, conversation)
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        # Beta sends alpha's exact history under alpha's id: a first turn of its own.
        intruder = run_turn(beta, local_pair.model, messages, conversation)
        assert intruder.plan == "recompute" and intruder.reused_tokens == 0
        _assert_same_answer(local_pair, intruder, messages)
        second = run_turn(alpha, local_pair.model, messages, conversation)
        assert second.plan == "pull-reuse"
        assert second.reused_tokens >= 0.9 * (first.prompt_tokens + first.completion_tokens)
        _assert_same_answer(local_pair, second, messages)
        reads.wait_for(1, min_bytes=second.reused_tokens * KV_BYTES_PER_TOKEN)
        for client in (alpha, beta):
            client.delete(control.release_path(conversation), cast_to=httpx.Response)


def _common_prefix_tokens(pair: LocalPair, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    def ids(messages: list[dict[str, Any]]) -> list[int]:
        body = {"model": pair.model, "messages": messages, "add_generation_prompt": False}
        return list(
            httpx.post(f"{pair.prefill_url}/tokenize", json=body, timeout=60).json()["tokens"]
        )

    x, y = ids(a), ids(b)
    pairs = enumerate(zip(x, y, strict=False))
    return next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))


def _two_turns(pair: LocalPair, client: openai.OpenAI, topic: str, conversation: str) -> list[Any]:
    messages = _opening(topic, 1200)
    for turn in range(2):
        got = run_turn(client, pair.model, messages, conversation)
        messages = [*messages, {"role": "assistant", "content": got.text}, _tool_result(turn)]
    return messages


@pytest.mark.parametrize("edit", ["drop-a-middle-message", "truncate-to-the-opening"])
def test_edited_history_reuses_only_the_common_prefix(
    local_pair: LocalPair, pull_url: str, edit: str
) -> None:
    client = _client(pull_url)
    conversation = f"test-{uuid.uuid4().hex[:8]}"
    messages = _two_turns(local_pair, client, f"volcanoes {edit}", conversation)
    held = messages[:-1]  # what decode holds: everything up to the last reply
    if edit == "drop-a-middle-message":
        edited = [m for i, m in enumerate(messages) if i != 3]  # the first tool result
    else:  # the agent keeps only its opening and asks something new
        edited = [*messages[:2], {"role": "user", "content": "Start over, briefly."}]
    reads = NixlReads(local_pair.prefill_url)
    got = run_turn(client, local_pair.model, edited, conversation)
    _assert_same_answer(local_pair, got, edited)
    assert got.plan == "pull-reuse"
    assert 0 < got.reused_tokens <= _common_prefix_tokens(local_pair, held, edited)
    reads.wait_for(1, min_bytes=got.reused_tokens * KV_BYTES_PER_TOKEN)


def test_lapsed_lease_falls_back_to_recompute(local_pair: LocalPair) -> None:
    with running_gateway(_pair_config(local_pair, lease_s=5.0)) as gateway:
        client = _client(gateway.url + "/v1")
        messages = _opening("lighthouses", 600)
        first = run_turn(client, local_pair.model, messages, "lease-test")
        wait_recorded(gateway, "lease-test")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        with _shifted_clock(gateway) as advance:
            advance(6.0)
            second = run_turn(client, local_pair.model, messages, "lease-test")
        assert second.plan == "recompute"
        assert second.reused_tokens == 0
        _assert_same_answer(local_pair, second, messages)
        assert _fallbacks(gateway.url, "lease-expired") == 1


def test_heartbeats_keep_the_lease_past_its_length(local_pair: LocalPair) -> None:
    """Two conversations paused longer than the lease: the one that sent heartbeats reuses."""
    with running_gateway(_pair_config(local_pair, lease_s=5.0)) as gateway:
        client = _client(gateway.url + "/v1")
        histories = {}
        for name in ("beating", "silent"):
            messages = _opening(f"tides {name}", 600)
            first = run_turn(client, local_pair.model, messages, name)
            wait_recorded(gateway, name)
            histories[name] = [*messages, {"role": "assistant", "content": first.text}]
        with _shifted_clock(gateway) as advance:
            for _ in range(4):  # 12 s of tool time, a heartbeat every 3 s
                advance(3.0)
                beat = httpx.post(
                    gateway.url + "/v1" + control.heartbeat_path("beating"),
                    json={"pause_kind": "tool"},
                )
                assert beat.status_code == 200 and beat.json()["lease_remaining_s"] > 0
            for name, plan in (("beating", "pull-reuse"), ("silent", "recompute")):
                messages = [*histories[name], _tool_result(0)]
                got = run_turn(client, local_pair.model, messages, name)
                assert got.plan == plan, name
                _assert_same_answer(local_pair, got, messages)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_tool_call_round_trip(local_pair: LocalPair, pull_url: str, stream: bool) -> None:
    client = _client(pull_url)
    conversation = f"tools-{uuid.uuid4().hex[:8]}"
    tools = [{
        "type": "function",
        "function": {
            "name": "read_sensor",
            "description": "Read a sensor by name.",
            "parameters": {"type": "object", "properties": {"name": {"enum": ["temp", "humidity"]}},
                           "required": ["name"]},
        },
    }]  # fmt: skip
    named = {"type": "function", "function": {"name": "read_sensor"}}
    messages = _opening(f"sensors {stream}", 400)
    call = run_turn(
        client, local_pair.model, messages, conversation, stream=stream, max_tokens=120,
        tools=tools, tool_choice=named,
    )  # fmt: skip
    assert call.tool_calls, "no tool call came back"
    tool_call = call.tool_calls[0]
    assert tool_call.function.name == "read_sensor"
    messages = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "42 degrees"},
    ]
    answer = run_turn(client, local_pair.model, messages, conversation, stream=stream, tools=tools)
    assert answer.plan == "pull-reuse"
    assert answer.reused_tokens > 0
    _assert_same_answer(local_pair, answer, messages, tools=tools)


@pytest.mark.parametrize("key", ["conversation_id", "prompt_cache_key"])
def test_conversation_keys_in_the_body(local_pair: LocalPair, pull_url: str, key: str) -> None:
    """Clients that cannot set headers name the conversation in the body."""
    client = _client(pull_url)
    messages = _opening(f"orchards {key}", 700)
    body = {key: f"body-{key}-{uuid.uuid4().hex[:6]}"}
    first = run_turn(client, local_pair.model, messages, extra_body=body)
    messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
    second = run_turn(client, local_pair.model, messages, extra_body=body)
    assert (first.plan, second.plan) == ("recompute", "pull-reuse")
    _assert_same_answer(local_pair, second, messages)


def test_completions_reuse_across_turns(local_pair: LocalPair, pull_url: str) -> None:
    client = _client(pull_url)
    conversation = {"X-Conversation-Id": f"complete-{uuid.uuid4().hex[:8]}"}
    prefill_requests = "vllm:request_success_total"
    requests_before = metric(f"{local_pair.prefill_url}/metrics", prefill_requests)
    prompt = long_prompt(900, "kites")
    reads = NixlReads(local_pair.prefill_url)
    for turn in range(2):
        raw = client.completions.with_raw_response.create(
            model=local_pair.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_headers=conversation, extra_body={"return_token_ids": True},
        )  # fmt: skip
        completion = raw.parse()
        assert raw.headers["x-kvturn-plan"] == ("recompute", "pull-reuse")[turn]
        got = list(getattr(completion.choices[0], "token_ids", None) or [])
        want = single_engine_completion_ids(
            local_pair.prefill_url, local_pair.model, prompt, MAX_TOKENS
        )
        assert got == want, f"turn {turn}: the answer differs from one engine alone"
        prompt = prompt + completion.choices[0].text + " Now tell me about the wind."
    reused = int(raw.headers["x-kvturn-reused-tokens"])
    assert reused > 800
    reads.wait_for(1, min_bytes=reused * KV_BYTES_PER_TOKEN)
    # Both turns went through prefill (it answered two prefill requests at least).
    deadline = time.monotonic() + 60
    while metric(f"{local_pair.prefill_url}/metrics", prefill_requests) - requests_before < 2:
        assert time.monotonic() < deadline, "prefill never served the completion turns"
        time.sleep(1)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        # The gateway's own: it must read the body.
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (b'{"model": "tiny", "messages": []}', 400, "messages"),
        # The engine's, passed on unchanged (tests/test_differential.py compares more).
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404,
         "model"),
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


def test_invalid_conversation_id_and_engine_errors(local_pair: LocalPair, pull_url: str) -> None:
    client = _client(pull_url)
    with pytest.raises(openai.BadRequestError, match="conversation id"):
        # Any string is an id (kvturn.headers.conversation_id_problem), up to 1,024 bytes.
        run_turn(client, local_pair.model, _opening("x", 50), conversation_id="x" * 1025)
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
        control_secret=local_pair.control_secret,
        health_interval_s=0.2,
    )
    with running_gateway(dead) as gateway:
        deadline = time.monotonic() + 30
        while httpx.get(gateway.url + "/health").json()["ok"]:
            assert time.monotonic() < deadline, "the dead prefill was never noticed"
            time.sleep(0.2)
        # Still ready: the decode engine serves turns alone, as one engine would.
        assert httpx.get(gateway.url + "/health").status_code == 200
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": local_pair.model, "messages": messages, "max_tokens": 8,
                "temperature": 0, "return_token_ids": True}  # fmt: skip
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvturn-plan-reason"] == "no-prefill"
        expected = single_engine_ids(local_pair.prefill_url, local_pair.model, messages, 8)
        assert response.json()["choices"][0]["token_ids"] == expected
    no_decode = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([f"http://127.0.0.1:{free_port()}"], [f"http://127.0.0.1:{free_port()}"]),
        control_secret=local_pair.control_secret,
        health_interval_s=0.2,
    )
    with running_gateway(no_decode) as gateway:
        # The prefill engine serves the turn alone, and keeps none of its KV (a prefill holds
        # no conversation's), though the turn names a conversation.
        baseline = kv_usage(local_pair.prefill_url)
        long = [{"role": "user", "content": long_prompt(1500, "alone " + uuid.uuid4().hex)}]
        headers = {"X-Conversation-Id": "no-decode-" + uuid.uuid4().hex}
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={**body, "messages": long},
            headers=headers,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-kvturn-plan-reason"] == "no-decode"
        alone = single_engine_ids(local_pair.prefill_url, local_pair.model, long, 8)
        assert response.json()["choices"][0]["token_ids"] == alone
        deadline = time.monotonic() + 30
        while kv_usage(local_pair.prefill_url) > baseline:
            assert time.monotonic() < deadline, (
                f"prefill kept the turn's KV ({kv_usage(local_pair.prefill_url)})"
            )
            time.sleep(0.2)
    nothing = GatewayConfig(
        prefill=endpoints([f"http://127.0.0.1:{free_port()}"]),
        decode=endpoints([f"http://127.0.0.1:{free_port()}"]),
        health_interval_s=0.2,
    )
    with running_gateway(nothing) as gateway:
        deadline = time.monotonic() + 30
        while httpx.get(gateway.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the dead engines were never noticed"
            time.sleep(0.2)
        body = {"model": local_pair.model, "messages": messages}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"


def test_below_threshold_recomputes(local_pair: LocalPair) -> None:
    with running_gateway(_pair_config(local_pair, reuse_threshold_tokens=10**6)) as gateway:
        client = _client(gateway.url + "/v1")
        messages = _opening("ferns", 500)
        first = run_turn(client, local_pair.model, messages, "small")
        wait_recorded(gateway, "small")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        second = run_turn(client, local_pair.model, messages, "small")
        assert (second.plan, second.reused_tokens) == ("recompute", 0)
        _assert_same_answer(local_pair, second, messages)
        assert _fallbacks(gateway.url, "below-threshold") == 1


def test_holder_dies_during_the_pull_and_another_holder_is_down(
    local_pair: LocalPair, tmp_path: Path
) -> None:
    """A second decode holds two conversations' KV and dies just as prefill pulls the first's:
    the real NIXL read fails (``pull-failed``), the turn's decode request finds the engine gone
    (``decode-failed``) and the turn is served again on the other decode; the second
    conversation's next turn sees its holder down (``holder-unhealthy``). Every answer equals
    one engine alone."""
    spec = extra_decode_spec(local_pair, 50)
    extra = EngineProcess(spec, tmp_path / "extra-decode.log").start()
    try:
        wait_until_healthy([extra], timeout_s=900)
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            # The extra decode is listed first, so it wins ties and holds the first turns.
            decode=endpoints(
                [spec.url, local_pair.decode_url],
                [f"http://127.0.0.1:{spec.control_port}", local_pair.decode_control_url],
            ),
            control_secret=local_pair.control_secret,
            health_interval_s=3600,  # only the gateway's own failures tell it the engine died
            decode_local=False,  # the pull path is what this test breaks
        )
        with running_gateway(config) as gateway:
            client = _client(gateway.url + "/v1")
            histories = {}
            for name in ("dies-mid-pull", "holder-down"):
                messages = _opening(f"meteors {name}", 600)
                first = run_turn(client, local_pair.model, messages, name)
                assert wait_recorded(gateway, name).holder_url == spec.url
                histories[name] = [*messages, {"role": "assistant", "content": first.text}]

            leases = gateway.app.state.gateway.runner.context.leases
            real_claim = leases.claim

            async def claim_then_kill(control_url: str, key: str) -> Any:
                outcome = await real_claim(control_url, key)
                assert outcome.params is not None, "turn 1's KV should still be leased"
                extra.stop()
                return outcome

            leases.claim = claim_then_kill
            messages = [*histories["dies-mid-pull"], _tool_result(0)]
            second = run_turn(client, local_pair.model, messages, "dies-mid-pull")
            leases.claim = real_claim
            assert (second.plan, second.reused_tokens) == ("recompute", 0)
            _assert_same_answer(local_pair, second, messages)
            assert _fallbacks(gateway.url, "pull-failed") == 1
            assert _fallbacks(gateway.url, "decode-failed") == 1

            messages = [*histories["holder-down"], _tool_result(0)]
            third = run_turn(client, local_pair.model, messages, "holder-down")
            assert third.plan == "recompute"
            _assert_same_answer(local_pair, third, messages)
            assert _fallbacks(gateway.url, "holder-unhealthy") == 1
            # Prefill is not left stuck by the failed read: it still serves.
            run_turn(client, local_pair.model, _opening("kelp", 300))
    finally:
        extra.stop()


def test_failed_pull_is_retried_as_recompute(local_pair: LocalPair) -> None:
    """The KV lapses between the lookup and the pull: prefill declines, the turn still works."""
    with running_gateway(_pair_config(local_pair)) as gateway:
        client = _client(gateway.url + "/v1")
        leases = gateway.app.state.gateway.runner.context.leases
        messages = _opening("harbours", 600)
        first = run_turn(client, local_pair.model, messages, "lapsing")
        wait_recorded(gateway, "lapsing")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        real_claim = leases.claim

        async def lapsed_claim(control_url: str, key: str) -> Any:
            outcome = await real_claim(control_url, key)
            assert outcome.params is not None, "turn 1's KV should still be leased"
            # Decode's deadline, on its perf_counter clock (the same machine, the same clock).
            outcome.params["remote_blocks_expiry_time"] = time.perf_counter() - 1
            return outcome

        leases.claim = lapsed_claim
        second = run_turn(client, local_pair.model, messages, "lapsing")
        assert second.plan == "recompute"
        assert second.reused_tokens == 0
        _assert_same_answer(local_pair, second, messages)
        # Prefill either failed the request (the gateway retried it as a recompute) or
        # declined the read and computed the prompt itself: either way nothing was reused.
        failed = _fallbacks(gateway.url, "pull-failed")
        declined = _fallbacks(gateway.url, "no-common-prefix")
        assert failed + declined == 1
        # Prefill is not left stuck (vLLM's "recompute" policy hangs here): it still serves.
        started = time.monotonic()
        run_turn(client, local_pair.model, _opening("kelp", 300))
        assert time.monotonic() - started < 120


def test_retained_kv_is_single_use_and_gone_kv_recomputes(local_pair: LocalPair) -> None:
    """Once prefill has read a decode's retained blocks, decode frees them and stops
    advertising them; a turn pointed at such blocks recomputes (``kv-gone``)."""
    with running_gateway(_pair_config(local_pair)) as gateway:
        client = _client(gateway.url + "/v1")
        messages = _opening("estuaries", 600)
        first = run_turn(client, local_pair.model, messages, "once")
        consumed = wait_recorded(gateway, "once").holder_request_id
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        second = run_turn(client, local_pair.model, messages, "once")
        assert second.plan == "pull-reuse"
        url = f"{local_pair.decode_control_url}/kvturn/retained/{consumed}"
        auth = local_pair.control_headers
        deadline = time.monotonic() + 30
        while httpx.get(url, headers=auth).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = httpx.get(url, headers=auth)
        assert gone.status_code == 404 and gone.json()["reason"] == "read"
        # Point the conversation at the blocks already read (as if decode had freed them).
        conversation = wait_recorded(gateway, "once")
        conversation.holder_request_id = consumed
        messages = [*messages, {"role": "assistant", "content": second.text}, _tool_result(1)]
        third = run_turn(client, local_pair.model, messages, "once")
        assert (third.plan, third.reused_tokens) == ("recompute", 0)
        _assert_same_answer(local_pair, third, messages)
        assert _fallbacks(gateway.url, "kv-gone") == 1


def test_kvturn_serve_in_front_of_running_engines(local_pair: LocalPair) -> None:
    """``kvturn serve`` as a user runs it, in its own process, in front of the pair."""
    port = free_port()
    command = [
        sys.executable, "-m", "kvturn.gateway.ops.cli", "serve",
        "--prefill", local_pair.prefill_url, "--decode", local_pair.decode_url,
        "--decode-control", local_pair.decode_control_url, "--port", str(port),
    ]  # fmt: skip
    env = {
        **os.environ,
        "KVTURN_REUSE_THRESHOLD_TOKENS": "100000",
        "KVTURN_CONTROL_SECRET": local_pair.control_secret,
    }
    server = subprocess.Popen(command, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "serve never came up"
            time.sleep(0.2)
        client = _client(url + "/v1")
        messages = _opening("comets", 500)
        first = run_turn(client, local_pair.model, messages, "served")
        messages = [*messages, {"role": "assistant", "content": first.text}, _tool_result(0)]
        second = run_turn(client, local_pair.model, messages, "served")
        # The environment's threshold (held tokens are far below 100000) reached the gateway.
        assert second.plan == "recompute"
        assert metric(url + "/metrics", 'kvturn_reuse_fallbacks_total{reason="below-threshold"}')
        _assert_same_answer(local_pair, second, messages)
        assert metric(url + "/metrics", "kvturn_live_conversations") == 1
        httpx.delete(url + "/v1" + control.release_path("served"))
        assert metric(url + "/metrics", "kvturn_live_conversations") == 0
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
