"""Faults on real engines: an engine killed or restarted, the gateway restarted. For each: no
hang, no 5xx where another engine could serve, and the next turn's answer equals one engine
alone. (A holder dying during the pull and a pull declined after expiry are in
``test_gateway_engines.py``; a lease lapsing mid-pull in ``test_leases_engines.py``.)

Extra engines start one at a time beside the session's pair (three engines at most)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
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
from tests.engine_requests import KV_BYTES_PER_TOKEN, NixlReads, long_prompt, single_engine_ids
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


def test_a_draining_holder_takes_no_new_turns_and_its_conversations_are_pulled_from_it(
    local_pair: LocalPair, extra_decode: dict[str, Any]
) -> None:
    """A decode asked to drain (its control server's ``/kvturn/drain``, a Kubernetes
    ``preStop``) still answers: the gateway's health checks see it draining, send it no new
    turn, and the conversation it holds continues elsewhere by a pull from it (prefill's NIXL
    reads say so), answering as one engine alone. Called off, it takes turns again."""
    spec: EngineSpec = extra_decode["spec"]
    config = replace(_two_decode_config(local_pair, spec), health_interval_s=0.5)
    control = f"http://127.0.0.1:{spec.control_port}/kvturn/drain"
    auth = {"Authorization": f"Bearer {local_pair.control_secret}"}
    with running_gateway(config) as gateway:
        client = _client(gateway.url)
        messages = _history("harbour cranes")
        first = run_turn(client, local_pair.model, messages, "drained")
        assert wait_recorded(gateway, "drained").holder_url == spec.url
        assert httpx.post(control, headers=auth).json()["draining"] is True
        try:
            deadline = time.monotonic() + 30
            while spec.url not in httpx.get(gateway.url + "/health").json()["draining"]:
                assert time.monotonic() < deadline, "the gateway never saw the drain"
                time.sleep(0.2)
            reads = NixlReads(local_pair.prefill_url)
            messages = _next(messages, first, 0)
            second = run_turn(client, local_pair.model, messages, "drained")
            assert (second.plan, second.reason) == ("pull-reuse", "holder-draining")
            reads.wait_for(1, min_bytes=KV_BYTES_PER_TOKEN * 512)
            handoffs = 'kvturn_drain_handoffs_total{outcome="pulled"}'
            assert metric(gateway.url + "/metrics", handoffs) == 1
            _assert_same_answer(local_pair, second, messages)
            assert wait_recorded(gateway, "drained").holder_url == local_pair.decode_url
            run_turn(client, local_pair.model, _history("tide gauges"), "new-while-draining")
            assert wait_recorded(gateway, "new-while-draining").holder_url == local_pair.decode_url
        finally:
            httpx.delete(control, headers=auth)
        deadline = time.monotonic() + 30
        while spec.url in httpx.get(gateway.url + "/health").json()["draining"]:
            assert time.monotonic() < deadline, "the drain was never called off"
            time.sleep(0.2)


#: Long enough to be mid-reply when the decode dies (the tiny model: ~15-30 ms a token here).
MIGRATED_TOKENS = 400


def _reference(pair: LocalPair, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One engine alone, streamed as the client streams (text as its detokenizer sends it)."""
    ref = {**body, "cache_salt": uuid.uuid4().hex, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    text = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with httpx.stream("POST", pair.prefill_url + path, json=ref, timeout=TURN_BOUND_S) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                _tool_calls(calls, choice)
                finish = choice.get("finish_reason") or finish
    return {"ids": ids, "text": text, "tool_calls": calls, "finish": finish}


def _tool_calls(calls: dict[int, dict[str, Any]], choice: dict[str, Any]) -> None:
    """A streamed chat choice's tool-call deltas, added up by index: every id announced for
    the index, its name, its arguments."""
    for call in (choice.get("delta") or {}).get("tool_calls") or ():
        got = calls.setdefault(call["index"], {"ids": [], "name": None, "arguments": ""})
        if call.get("id"):
            got["ids"].append(call["id"])
        function = call.get("function") or {}
        got["name"] = function.get("name") or got["name"]
        got["arguments"] += function.get("arguments") or ""


def _first_difference(got: list[Any] | str, want: list[Any] | str) -> int:
    """Where two replies first differ: the first unequal position, else the shorter's length."""
    pairs = enumerate(zip(got, want, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))


def _divergence(got: list[Any] | str, want: list[Any] | str) -> str:
    at = _first_difference(got, want)
    if at == min(len(got), len(want)):
        return f"lengths {len(got)} and {len(want)}"
    return f"first divergence at {at}: {got[at : at + 8]!r} against {want[at : at + 8]!r}"


def _gateway_request(
    url: str, path: str, body: dict[str, Any], started: threading.Event
) -> dict[str, Any]:
    """A request through the gateway: the reply's ids (where asked), text, finish, usage and
    whether an error came; ``started`` is set once a streamed reply has sent its first event."""
    got: dict[str, Any] = {"ids": [], "text": "", "finish": None, "usage": None, "error": None,
                           "tool_calls": {}}  # fmt: skip
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, timeout=TURN_BOUND_S)
        data = response.json()
        if response.status_code != 200:
            got["error"] = data
            return got
        choice = data["choices"][0]
        got.update(ids=choice.get("token_ids") or [], finish=choice["finish_reason"])
        got.update(text=(choice.get("message") or {}).get("content") or choice.get("text"))
        got["usage"] = data["usage"]
        return got
    events = 0
    with httpx.stream("POST", url + path, json=body, timeout=TURN_BOUND_S) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = orjson.loads(line[6:])
            if "error" in payload or payload.get("type") in ("error", "response.failed"):
                got["error"] = payload.get("error") or payload
            kind = payload.get("type") or ""
            if kind == "response.output_text.delta":  # a Responses stream's events
                got["text"] += payload["delta"]
            elif kind in ("response.completed", "response.incomplete"):
                got["usage"], got["finish"] = payload["response"]["usage"], kind
            got["usage"] = payload.get("usage") or got["usage"]
            for choice in payload.get("choices") or ():
                # Ids only to those who asked (others get vLLM's null).
                assert choice.get("token_ids") is None or body.get("return_token_ids"), choice
                got["ids"] += choice.get("token_ids") or []
                got["text"] += (
                    (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                )
                _tool_calls(got["tool_calls"], choice)
                got["finish"] = choice.get("finish_reason") or got["finish"]
            events += 1
            if events == 1:
                started.set()
    return got


def _replies_through_a_fault(
    gateway_url: str,
    requests: dict[str, tuple[str, dict[str, Any]]],
    idle_decode: Any,
    fault: Callable[[], None],
    undo: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, Any]]:
    """Every request at once through the gateway while ``idle_decode`` counts as busy, so each
    lands on the other decode (the gateway picks the least loaded; a health check would undo
    a mark of "down"); once every stream has begun and run a moment more, ``fault`` strikes
    that decode; the replies, then ``undo``."""
    streamed = [name for name, (_, body) in requests.items() if body.get("stream")]
    started = {name: threading.Event() for name in requests}
    idle_decode.in_flight += 100
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {
            name: pool.submit(_gateway_request, gateway_url, path, body, started[name])
            for name, (path, body) in requests.items()
        }
        for name in streamed:
            assert started[name].wait(TURN_BOUND_S), f"{name}: no reply began"
        idle_decode.in_flight -= 100
        # Every stream has begun (a stream of mostly held-back bytes sends few events); a
        # moment more and each is well into its 400 tokens.
        time.sleep(1.0)
        fault()
        try:
            return {name: future.result(TURN_BOUND_S) for name, future in futures.items()}
        finally:
            undo()


#: A tool offered to the kill test's model.
RECORD_TOOL = {"type": "function", "function": {
    "name": "record_readings", "description": "Record the gauges' readings.",
    "parameters": {"type": "object", "required": ["readings"], "properties": {"readings": {
        "type": "array", "items": {"type": "integer"}}}}}}  # fmt: skip


def _calls(calls: dict[int, dict[str, Any]]) -> dict[int, tuple[str | None, str]]:
    """Tool calls by index, as (name, arguments): their ids are each engine's own."""
    return {index: (call["name"], call["arguments"]) for index, call in calls.items()}


def _text_failure(name: str, got: str, want: str) -> str | None:
    """Where a text-only reply differs from one engine alone's: the failure, or ``None`` (a
    warning) where invalid UTF-8 at the seam is the cause: the tiny model's random bytes are
    invalid UTF-8, and the continuation's detokenizer (tokenizers' DecodeStream, primed with
    the whole prompt) renders the characters after such a seam differently. The ids are exact
    (the streams that asked for them)."""
    if got == want:
        return None
    report = f"{name}: text {_divergence(got, want)}"
    at = _first_difference(got, want)
    if "\ufffd" not in want[max(0, at - 8) : at + 8]:
        return report
    warnings.warn(f"{report}: invalid UTF-8 (U+FFFD) at the seam", stacklevel=2)
    return None


def test_decode_hung_mid_stream_every_reply_continues_on_another_engine(
    local_pair: LocalPair, extra_decode: dict[str, Any]
) -> None:
    """A decode that hangs mid-reply (SIGSTOP: its processes alive, its connections open,
    nothing comes): health checks mark it unhealthy, and each stream on it, quiet since,
    continues on the other decode, token for token as one engine alone, its usage counting
    the original prompt and every reply token once, with vLLM's cached tokens. A Responses
    stream (a chat turn's, translated) continues too. Resumed, the engine answers health
    checks again and rejoins."""
    spec: EngineSpec = extra_decode["spec"]
    engine: EngineProcess = extra_decode["engine"]
    config = replace(_two_decode_config(local_pair, spec), health_interval_s=1.0)
    common = {"model": local_pair.model, "max_tokens": MIGRATED_TOKENS, "temperature": 0,
              "ignore_eos": True, "stream": True, "return_token_ids": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    requests = {
        "chat": ("/v1/chat/completions", {**common, "messages": _history("tide gauges")}),
        "completion": ("/v1/completions", {**common, "prompt": long_prompt(500, "culverts")}),
    }
    # A Responses stream is a chat turn's, translated: it continues as the chat stream does.
    responses = {
        "model": local_pair.model,
        "input": long_prompt(500, "flood gates"),
        "max_output_tokens": MIGRATED_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    responses_reference = {"model": local_pair.model, "max_tokens": MIGRATED_TOKENS,
                           "temperature": 0, "ignore_eos": True, "messages": [
                               {"role": "user", "content": responses["input"]}]}  # fmt: skip
    every = {**requests, "responses": ("/v1/responses", responses)}
    with running_gateway(config) as gateway:
        decodes = {i.url: i for i in gateway.app.state.gateway.decode.instances}
        assert engine.pid is not None
        pid = engine.pid
        replies = _replies_through_a_fault(
            gateway.url, every, decodes[local_pair.decode_url],
            fault=lambda: os.killpg(pid, signal.SIGSTOP),
            undo=lambda: os.killpg(pid, signal.SIGCONT),
        )  # fmt: skip
        for name, (path, body) in requests.items():
            got, want = replies[name], _reference(local_pair, path, body)
            assert got["error"] is None, f"{name}: {got['error']}"
            assert got["ids"] == want["ids"], f"{name}: {_divergence(got['ids'], want['ids'])}"
            usage = got["usage"]
            assert usage["completion_tokens"] == MIGRATED_TOKENS, (name, usage)
            # vLLM's count for a P/D reply, prefill's own cache hits: none here (its prefix
            # cache is off in this pair), carried across the seam all the same.
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0, (name, usage)
        got = replies["responses"]
        want = _reference(local_pair, "/v1/chat/completions", responses_reference)
        assert got["error"] is None, got["error"]
        failure = _text_failure("responses", got["text"], want["text"])
        assert failure is None, failure
        assert got["usage"]["output_tokens"] == len(want["ids"]), got["usage"]
        continued = metric(
            gateway.url + "/metrics", 'kvturn_stream_migrations_total{outcome="continued"}'
        )
        assert continued == len(every), "every stream moved once"
        deadline = time.monotonic() + 60
        while not decodes[spec.url].healthy:
            assert time.monotonic() < deadline, "the resumed decode never rejoined"
            time.sleep(0.5)


def test_decode_killed_mid_stream_every_reply_continues_on_another_engine(
    local_pair: LocalPair, extra_decode: dict[str, Any]
) -> None:
    """Several replies at once on a decode that is SIGKILLed mid-way (chat and completions,
    streamed and whole): every one completes, on the other decode, and equals one engine
    alone token for token. A streamed reply continues from the tokens it had sent (one
    stream's client never sees token ids, only text); a whole one is served again."""
    spec: EngineSpec = extra_decode["spec"]
    model = local_pair.model
    with running_gateway(_two_decode_config(local_pair, spec)) as gateway:
        decodes = {i.url: i for i in gateway.app.state.gateway.decode.instances}
        common = {"model": model, "max_tokens": MIGRATED_TOKENS, "temperature": 0,
                  "ignore_eos": True}  # fmt: skip
        usage = {"stream_options": {"include_usage": True}}
        chat_path, completions_path = "/v1/chat/completions", "/v1/completions"
        requests = {
            "chat streamed, ids": (chat_path, {
                **common, **usage, "messages": _history("storm drains"), "stream": True,
                "return_token_ids": True}),
            "chat streamed, text only": (chat_path, {
                **common, **usage, "messages": _history("ferry timetables"), "stream": True}),
            "completion streamed": (completions_path, {
                **common, **usage, "prompt": long_prompt(500, "weirs"), "stream": True,
                "return_token_ids": True}),
            # A reply that may call tools (vLLM's tool parser reads it): replayed from
            # scratch on the other decode and relayed from the seam on (the tiny model calls
            # none; tool-call deltas across a seam: tests/unit/test_replay.py).
            "chat streamed, tools offered": (chat_path, {
                **common, **usage, "messages": _history("pumping stations"), "stream": True,
                "tools": [RECORD_TOOL], "tool_choice": "auto"}),
            "chat whole": (chat_path, {
                **common, "messages": _history("canal locks"), "return_token_ids": True}),
            "completion whole": (completions_path, {
                **common, "prompt": long_prompt(500, "sluices"), "return_token_ids": True}),
        }  # fmt: skip
        streamed = [name for name, (_, body) in requests.items() if body.get("stream")]
        replies = _replies_through_a_fault(
            gateway.url, requests, decodes[local_pair.decode_url],
            fault=lambda: extra_decode["engine"].stop(grace_s=0),  # SIGTERM, SIGKILL at once
        )  # fmt: skip

        failures = []
        for name, (path, body) in requests.items():
            got, want = replies[name], _reference(local_pair, path, body)
            assert got["error"] is None, f"{name}: {got['error']}"
            # The same calls, if any, each announced once (its id, not the reference's).
            assert _calls(got["tool_calls"]) == _calls(want["tool_calls"]), name
            assert all(len(call["ids"]) == 1 for call in got["tool_calls"].values()), name
            assert got["finish"] == "length", name
            assert got["usage"]["completion_tokens"] == MIGRATED_TOKENS, (name, got["usage"])
            assert got["usage"]["prompt_tokens"] + MIGRATED_TOKENS == got["usage"]["total_tokens"]
            if name in streamed:  # carried across the seam (0: prefill's cache is off here)
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, name
            if body.get("return_token_ids"):
                if got["ids"] != want["ids"]:
                    failures.append(f"{name}: ids {_divergence(got['ids'], want['ids'])}")
            elif (failure := _text_failure(name, got["text"], want["text"])) is not None:
                failures.append(failure)
        assert not failures, failures
        continued = metric(
            gateway.url + "/metrics", 'kvturn_stream_migrations_total{outcome="continued"}'
        )
        assert continued == len(streamed), "every stream moved once"
        assert not decodes[spec.url].healthy  # marked by its broken streams

        # The conversation's next turn is served on the live decode, as one engine alone.
        messages = _history("storm drains")
        third = run_turn(_client(gateway.url), model, messages, "after-the-kill")
        _assert_same_answer(local_pair, third, messages)
        assert wait_recorded(gateway, "after-the-kill").holder_url == local_pair.decode_url


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
