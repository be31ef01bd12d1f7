"""Decode-side leases on the real engine pair: heartbeats keep KV past the base retention,
release frees the blocks at once, the control channel refuses strangers, a pull racing an expiry
still answers right, and turns without a conversation pin nothing.

The heartbeat test runs the issue's scale (a base lease of 20 s, a pause of 60 s); the others
use shorter leases where the logic does not depend on the scale.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn.client import OpenAI as KvturnOpenAI
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.launch.engines import EngineProcess, KVSettings, wait_until_healthy
from tests.conftest import TEST_KV_TTL_S, LocalPair
from tests.engine_requests import (
    KV_BYTES_PER_TOKEN,
    NixlReads,
    extra_decode_spec,
    long_prompt,
    single_engine_ids,
)
from tests.gateway_fixtures import TurnResult, metric, run_turn, running_gateway, wait_recorded

pytestmark = pytest.mark.engines

#: The base lease of these tests' gateways; a pause of three leases outlives it for sure.
BASE_LEASE_S = 20.0
MAX_TOKENS = 16


def _config(pair: LocalPair, **overrides: Any) -> GatewayConfig:
    return GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints([pair.decode_url], [pair.decode_control_url]),
        control_secret=pair.control_secret,
        decode_local=False,  # these tests prove the pull path
        implicit_conversations=False,  # and that turns without an id pin nothing
        **overrides,
    )


def _opening(topic: str, tokens: int = 600) -> list[dict[str, Any]]:
    return [{"role": "user", "content": long_prompt(tokens, f"{topic} {uuid.uuid4().hex[:6]}")}]


def _next(messages: list[dict[str, Any]], reply: TurnResult) -> list[dict[str, Any]]:
    return [
        *messages,
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": "go on: " + "and then? " * 20},
    ]


def _assert_same_answer(pair: LocalPair, got: TurnResult, messages: list[dict[str, Any]]) -> None:
    want = single_engine_ids(pair.prefill_url, pair.model, messages, MAX_TOKENS)
    assert got.token_ids == want, "reuse changed the answer"


def _decode_stats(pair: LocalPair) -> dict[str, Any]:
    url = f"{pair.decode_control_url}/kvturn/leases"
    return dict(httpx.get(url, headers=pair.control_headers, timeout=10).json())


def _ended(pair: LocalPair, reason: str) -> int:
    return int(_decode_stats(pair)["ended"].get(reason, 0))


def _kv_usage(pair: LocalPair) -> float:
    return metric(f"{pair.decode_url}/metrics", "vllm:kv_cache_usage_perc")


def test_client_heartbeats_keep_kv_past_the_base_lease(local_pair: LocalPair) -> None:
    """Two conversations pause for three base leases; kvturn.client beats for one of them.
    The beating one reuses (a real NIXL read, the same answer as one engine alone); the other's
    lease lapsed on decode, which freed its blocks, and its turn recomputes."""
    with running_gateway(_config(local_pair, lease_s=BASE_LEASE_S)) as gateway:
        base = gateway.url + "/v1"
        beating = KvturnOpenAI(base_url=base, api_key="-", max_retries=0, timeout=300)
        silent = KvturnOpenAI(base_url=base, api_key="-", max_retries=0, timeout=300,
                              heartbeats=False)  # fmt: skip
        expired_before = _ended(local_pair, "expired")
        histories: dict[str, list[dict[str, Any]]] = {}
        for name, client in (("beating", beating), ("silent", silent)):
            with client.conversation(name, release=False):
                messages = _opening(f"tides {name}")
                first = run_turn(client, local_pair.model, messages)
                histories[name] = _next(messages, first)
            wait_recorded(gateway, name)
        time.sleep(3 * BASE_LEASE_S)  # a long tool run: beats go out every half lease
        assert metric(gateway.url + "/metrics", 'kvturn_lease_renewals_total{result="renewed"}')
        # The silent conversation's lease ran out on decode (its blocks are freed).
        assert _ended(local_pair, "expired") - expired_before >= 1
        reads = NixlReads(local_pair.prefill_url)
        with beating.conversation("beating", release=True):
            got = run_turn(beating, local_pair.model, histories["beating"])
        assert got.plan == "pull-reuse" and got.reused_tokens >= 600
        _assert_same_answer(local_pair, got, histories["beating"])
        reads.wait_for(1, min_bytes=got.reused_tokens * KV_BYTES_PER_TOKEN)
        with silent.conversation("silent", release=True):
            got = run_turn(silent, local_pair.model, histories["silent"])
        assert (got.plan, got.reused_tokens) == ("recompute", 0)
        _assert_same_answer(local_pair, got, histories["silent"])
        beating.close()
        silent.close()


def test_release_frees_the_blocks_at_once(local_pair: LocalPair) -> None:
    with running_gateway(_config(local_pair, lease_s=300.0)) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        run_turn(client, local_pair.model, _opening("quarries", 1500), "released")
        key = wait_recorded(gateway, "released").holder_request_id
        lease = httpx.get(
            f"{local_pair.decode_control_url}/kvturn/retained/{key}",
            headers=local_pair.control_headers,
        ).json()
        blocks = len(lease["remote_block_ids"][0])
        assert blocks * _block_size(local_pair) >= 1500
        held, usage = _decode_stats(local_pair)["blocks_held"], _kv_usage(local_pair)
        # The gateway's /metrics shows the decode connector's own counts.
        gateway_metrics = gateway.url + "/metrics"
        assert metric(gateway_metrics, "kvturn_decode_lease_blocks") >= blocks
        assert metric(gateway_metrics, "kvturn_decode_leases") >= 1
        decode = local_pair.decode_url
        ended = f'kvturn_decode_lease_events{{decode="{decode}",event="ended_released"}}'
        released_before = metric(gateway_metrics, ended)
        released = httpx.delete(gateway.url + "/v1/kvturn/conversations/released")
        assert released.json()["released"] is True
        # Within a second decode has freed the lease's blocks: by the connector's count and
        # by vLLM's own KV usage gauge (other leases may lapse meanwhile, none can start).
        freed = blocks / _num_blocks(local_pair)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            now_held, now_usage = _decode_stats(local_pair)["blocks_held"], _kv_usage(local_pair)
            if now_held <= held - blocks and now_usage <= usage - freed + 1e-9:
                break
            time.sleep(0.05)
        assert _decode_stats(local_pair)["blocks_held"] <= held - blocks
        assert _kv_usage(local_pair) <= usage - freed + 1e-9
        assert metric(gateway_metrics, ended) == released_before + 1


def _cache_config(pair: LocalPair, label: str) -> int:
    for line in httpx.get(f"{pair.decode_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return int(line.split(f'{label}="', 1)[1].split('"', 1)[0])
    raise AssertionError("decode serves no vllm:cache_config_info")


def _block_size(pair: LocalPair) -> int:
    return _cache_config(pair, "block_size")


def _num_blocks(pair: LocalPair) -> int:
    return _cache_config(pair, "num_gpu_blocks")


def test_strangers_cannot_touch_a_lease(local_pair: LocalPair) -> None:
    """Renew, release and claim without the gateway's secret: 401, and the lease is as it was
    (the conversation's next turn still reuses it)."""
    with running_gateway(_config(local_pair, lease_s=60.0)) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        messages = _opening("vaults")
        first = run_turn(client, local_pair.model, messages, "guarded")
        key = wait_recorded(gateway, "guarded").holder_request_id
        control = f"{local_pair.decode_control_url}/kvturn"

        def lease() -> dict[str, Any]:
            got = httpx.get(f"{control}/retained/{key}", headers=local_pair.control_headers)
            assert got.status_code == 200
            return dict(got.json())

        before = lease()
        for headers in ({}, {"Authorization": "Bearer not-the-secret"}):
            renew = httpx.post(f"{control}/leases/{key}/renew", json={"lease_s": 3600},
                               headers=headers)  # fmt: skip
            assert renew.status_code == 401
            assert httpx.delete(f"{control}/leases/{key}", headers=headers).status_code == 401
            assert httpx.post(f"{control}/leases/{key}/claim", headers=headers).status_code == 401
        after = lease()
        assert after["expires_in_s"] <= before["expires_in_s"]  # not extended
        messages = _next(messages, first)
        second = run_turn(client, local_pair.model, messages, "guarded")
        assert second.plan == "pull-reuse"
        _assert_same_answer(local_pair, second, messages)
        httpx.delete(gateway.url + "/v1/kvturn/conversations/guarded")


def test_a_pull_racing_the_expiry_still_answers_right(local_pair: LocalPair) -> None:
    """Turns sent around the moment their lease ends (the gateway set to try even just after
    it): each is served, by a pull that the claim made safe or by a recompute, never an error,
    and every answer equals one engine alone."""
    lease_s = 2.0
    config = _config(local_pair, lease_s=lease_s, expiry_margin_s=-1.0)
    with running_gateway(config) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        plans = []
        for offset in (-0.3, -0.1, 0.0, 0.1, 0.3):
            name = f"race-{offset}"
            messages = _opening("glaciers", 400)
            first = run_turn(client, local_pair.model, messages, name)
            wait_recorded(gateway, name)
            recorded = time.monotonic()
            messages = _next(messages, first)
            time.sleep(max(0.0, recorded + lease_s + offset - time.monotonic()))
            got = run_turn(client, local_pair.model, messages, name)
            _assert_same_answer(local_pair, got, messages)
            plans.append(got.plan)
            httpx.delete(gateway.url + f"/v1/kvturn/conversations/{name}")
        # Both sides of the race were seen: the early turns reused, the late ones recomputed.
        assert plans[0] == "pull-reuse" and plans[-1] == "recompute", plans


def test_turns_without_a_conversation_pin_nothing(local_pair: LocalPair) -> None:
    """Plain P/D traffic (no id, implicit conversations off): decode keeps none of it once the
    reply ends."""
    with running_gateway(_config(local_pair)) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        before = _decode_stats(local_pair)
        errors: list[BaseException] = []

        def plain(i: int) -> None:
            try:
                run_turn(client, local_pair.model, _opening(f"plain {i}", 800))
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        after = _decode_stats(local_pair)
        assert after["not_retained"] - before["not_retained"] == 4
        assert after["retained"] == before["retained"]
        assert after["blocks_held"] <= before["blocks_held"]


#: Decode KV blocks of the small decode in the pressure test (vLLM-CPU blocks hold 128 tokens):
#: about four conversations of ~1k tokens, far fewer than the test opens.
SMALL_DECODE_BLOCKS = 40


def test_memory_pressure_reclaims_by_expected_return(
    local_pair: LocalPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode whose KV holds about four conversations, with a lease far longer than the test:
    every turn is served at once (none waits for a lease to lapse), leases are reclaimed to make
    room, a conversation in a user pause before one in a tool pause, and a reclaimed
    conversation's next turn recomputes with the same answer. Plain traffic without ids pins
    nothing and never waits either."""
    monkeypatch.setenv("KVTURN_CONTROL_SECRET", local_pair.control_secret)
    spec = extra_decode_spec(
        local_pair,
        60,
        max_model_len=4096,
        extra_args=("--num-gpu-blocks-override", str(SMALL_DECODE_BLOCKS)),
    )
    small = EngineProcess(spec, tmp_path / "small-decode.log").start()
    control = f"http://127.0.0.1:{spec.control_port}"
    try:
        wait_until_healthy([small], timeout_s=900)
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            decode=endpoints([spec.url], [control]),
            control_secret=local_pair.control_secret,
            decode_local=False,  # these tests prove the pull path
            implicit_conversations=False,  # and that turns without an id pin nothing
            lease_s=float(TEST_KV_TTL_S),
        )
        with running_gateway(config) as gateway:
            # A turn that waited for a lease to lapse would take minutes: the client gives up
            # long before.
            client = openai.OpenAI(
                base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=90
            )
            beat_url = gateway.url + "/v1/kvturn/conversations/{}/heartbeat"
            histories: dict[str, list[dict[str, Any]]] = {}
            keys: dict[str, str] = {}

            def open_conversation(name: str) -> None:
                messages = _opening(f"pressure {name}", 900)
                first = run_turn(client, local_pair.model, messages, name)
                histories[name] = _next(messages, first)
                keys[name] = wait_recorded(gateway, name).holder_request_id

            def alive(name: str) -> bool:
                url = f"{control}/kvturn/retained/{keys[name]}"
                return httpx.get(url, headers=local_pair.control_headers).status_code == 200

            for name, kind in (("tool-pause", "tool"), ("user-pause", "user")):
                open_conversation(name)
                beat = httpx.post(beat_url.format(name), json={"pause_kind": kind})
                assert beat.json()["lease_remaining_s"] > 0
            fillers = [f"filler-{i}" for i in range(6)]
            for name in fillers:
                open_conversation(name)
                # The user pause goes first; the tool pause outlives every filler.
                assert alive("tool-pause"), f"the tool pause was reclaimed by {name}"
            assert not alive("user-pause")
            stats = httpx.get(f"{control}/kvturn/leases", headers=local_pair.control_headers)
            reclaimed = stats.json()["ended"].get("reclaimed", 0)
            assert reclaimed >= 3, stats.json()
            assert stats.json()["blocks_held"] <= SMALL_DECODE_BLOCKS

            got = run_turn(client, local_pair.model, histories["user-pause"], "user-pause")
            assert (got.plan, got.reused_tokens) == ("recompute", 0)
            _assert_same_answer(local_pair, got, histories["user-pause"])
            assert metric(
                gateway.url + "/metrics", 'kvturn_reuse_fallbacks_total{reason="lease-reclaimed"}'
            )
            got = run_turn(client, local_pair.model, histories["tool-pause"], "tool-pause")
            assert got.plan == "pull-reuse"
            _assert_same_answer(local_pair, got, histories["tool-pause"])

            # Plain traffic, two at a time, more than the cache holds in all: nothing retained.
            before = httpx.get(f"{control}/kvturn/leases", headers=local_pair.control_headers)
            errors: list[BaseException] = []

            def plain(i: int) -> None:
                try:
                    run_turn(client, local_pair.model, _opening(f"plain pressure {i}", 1500))
                except BaseException as error:
                    errors.append(error)

            for batch in range(3):
                threads = [threading.Thread(target=plain, args=(2 * batch + j,)) for j in (0, 1)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            assert not errors, errors
            after = httpx.get(f"{control}/kvturn/leases", headers=local_pair.control_headers)
            assert after.json()["not_retained"] - before.json()["not_retained"] == 6
            assert after.json()["retained"] == before.json()["retained"]
        _decode_local_under_pressure(local_pair, spec.url, control)
    finally:
        small.stop()


def _decode_local_under_pressure(pair: LocalPair, decode_url: str, control: str) -> None:
    """Decode-local reuse under memory pressure on the small decode: a leased conversation's
    next turn is served from the holder's cache after more traffic than the decode holds,
    because the lease kept its blocks; the same conversation released first (vLLM's prefix
    cache alone then keeps its freed blocks only until newer requests need them) is served
    from nothing there. Uncontended, vLLM's prefix cache keeps freed blocks anyway, so only
    pressure shows the lease doing the work. A conversation whose lease pressure took (a user
    pause) is found gone when its turn is planned: prefill recomputes it, and the holder
    computes none of the lost history beside its streams."""
    config = GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints([decode_url], [control]),
        control_secret=pair.control_secret,
        implicit_conversations=False,
        lease_s=float(TEST_KV_TTL_S),
        # On one host a pull and a local prefill cost about the same: the lease's turn must
        # stay on its holder whatever the learned costs say (see test_planner_engines.py).
        local_preference=1.0,
    )

    def counters() -> tuple[float, float]:
        return (
            metric(f"{decode_url}/metrics", "vllm:request_success_total"),
            metric(f"{decode_url}/metrics", "vllm:prefix_cache_hits_total"),
        )

    def decode_computed() -> float:
        """Prompt tokens decode computed itself (vLLM's count by source)."""
        lines = httpx.get(f"{decode_url}/metrics", timeout=10).text.splitlines()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("vllm:prompt_tokens_by_source_total{")
            and 'source="local_compute"' in line
        )

    def decode_hits(before: tuple[float, float]) -> float:
        """Decode's prefix-cache hits since ``before``, once it finished one more request."""
        deadline = time.monotonic() + 10
        while counters()[0] <= before[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the finishing step's stats
        return counters()[1] - before[1]

    with running_gateway(config) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        histories: dict[str, list[dict[str, Any]]] = {}
        for name in ("held", "released", "reclaimed"):
            messages = _opening(f"local pressure {name}", 900)
            first = run_turn(client, pair.model, messages, name)
            histories[name] = _next(messages, first)
            wait_recorded(gateway, name)
        for name, kind in (("held", "tool"), ("reclaimed", "user")):
            beat = httpx.post(
                gateway.url + f"/v1/kvturn/conversations/{name}/heartbeat",
                json={"pause_kind": kind},
            )
            assert beat.json()["lease_remaining_s"] > 0
        assert httpx.delete(gateway.url + "/v1/kvturn/conversations/released").status_code < 300
        # More than the decode holds (about 8 blocks a conversation, 40 in all).
        for i in range(6):
            run_turn(client, pair.model, _opening(f"local pressure filler {i}", 900), f"f{i}")

        before = counters()
        got = run_turn(client, pair.model, histories["held"], "held")
        assert (got.plan, got.reason) == ("decode-local", "cheaper")
        hits = decode_hits(before)
        assert hits >= got.reused_tokens >= 768, (hits, got.reused_tokens)
        _assert_same_answer(pair, got, histories["held"])

        before = counters()
        got = run_turn(client, pair.model, histories["released"], "released")
        assert got.plan == "recompute" and got.reused_tokens == 0
        # Its history was evicted: decode took the whole prompt from prefill.
        assert decode_hits(before) < 128, "the released history survived the pressure"
        _assert_same_answer(pair, got, histories["released"])

        # The user pause's lease went first; the gateway's table still had it live.
        before, computed = counters(), decode_computed()
        got = run_turn(client, pair.model, histories["reclaimed"], "reclaimed")
        assert (got.plan, got.reason) == ("recompute", "lease-reclaimed")
        decode_hits(before)  # once decode's stats show the turn
        assert decode_computed() - computed < 64, "the holder recomputed the lost history"
        _assert_same_answer(pair, got, histories["reclaimed"])


#: The longest lease of the short-lease decode below (its ``--kv-ttl``), under the gateway's
#: default lease (60 s), and a pause that outlives it twice over.
SHORT_TTL_S = 20
LONG_PAUSE_S = 50


def test_heartbeats_keep_a_lease_the_decode_cut_short(
    local_pair: LocalPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode that grants leases of at most 20 s (``kvturn up --kv-ttl 20``) behind a gateway
    whose own lease is its default 60 s: the gateway tells the client 20, kvturn.client beats
    every 10 s, and after a 50 s tool pause the conversation reuses its KV (a real NIXL read,
    the same answer as one engine alone); a conversation that sends no heartbeats recomputes.
    Before, the client was told 60 s and beat first at 30 s, after the decode had freed it."""
    monkeypatch.setenv("KVTURN_CONTROL_SECRET", local_pair.control_secret)
    spec = extra_decode_spec(
        local_pair,
        90,
        cpu=1,
        kv=KVSettings(decoder_kv_blocks_ttl_s=SHORT_TTL_S),
        max_model_len=4096,
    )
    short = EngineProcess(spec, tmp_path / "short-lease-decode.log").start()
    control = f"http://127.0.0.1:{spec.control_port}"
    try:
        wait_until_healthy([short], timeout_s=900)
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            decode=endpoints([spec.url], [control]),
            control_secret=local_pair.control_secret,
            decode_local=False,  # a pull is the evidence: NIXL reads from the decode
            implicit_conversations=False,
        )
        assert config.lease_s > SHORT_TTL_S
        with running_gateway(config) as gateway:
            decode = gateway.app.state.gateway.decode.instances[0]
            deadline = time.monotonic() + 30
            while decode.max_lease_s != SHORT_TTL_S:
                assert time.monotonic() < deadline, "the decode's longest lease was never learned"
                time.sleep(0.2)
            base = gateway.url + "/v1"
            beating = KvturnOpenAI(base_url=base, api_key="-", max_retries=0, timeout=300)
            silent = KvturnOpenAI(base_url=base, api_key="-", max_retries=0, timeout=300,
                                  heartbeats=False)  # fmt: skip
            histories: dict[str, list[dict[str, Any]]] = {}
            for name, client in (("short-beating", beating), ("short-silent", silent)):
                with client.conversation(name, release=False):
                    messages = _opening(f"estuaries {name}")
                    first = run_turn(client, local_pair.model, messages)
                    histories[name] = _next(messages, first)
                wait_recorded(gateway, name)
            stats = httpx.get(f"{control}/kvturn/leases", headers=local_pair.control_headers)
            expired_before = int(stats.json()["ended"].get("expired", 0))
            time.sleep(LONG_PAUSE_S)  # a long tool run: beats go out every half lease
            stats = httpx.get(f"{control}/kvturn/leases", headers=local_pair.control_headers)
            assert int(stats.json()["ended"].get("expired", 0)) - expired_before >= 1
            reads = NixlReads(local_pair.prefill_url)
            with beating.conversation("short-beating", release=True):
                got = run_turn(beating, local_pair.model, histories["short-beating"])
            assert got.plan == "pull-reuse" and got.reused_tokens >= 600, got
            _assert_same_answer(local_pair, got, histories["short-beating"])
            reads.wait_for(1, min_bytes=got.reused_tokens * KV_BYTES_PER_TOKEN)
            with silent.conversation("short-silent", release=True):
                got = run_turn(silent, local_pair.model, histories["short-silent"])
            assert (got.plan, got.reused_tokens) == ("recompute", 0)
            _assert_same_answer(local_pair, got, histories["short-silent"])
            beating.close()
            silent.close()
    finally:
        short.stop()
