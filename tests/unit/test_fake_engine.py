"""The fake engine claims no reuse it does not hold: it tokenizes every prompt, keys its prefix
cache by token ids and cache salt, and its own evidence (usage, ``/metrics``, what a pull reads)
comes from the blocks it holds. A gateway test that reads that evidence would fail if the
engine recomputed everything while the gateway claimed reuse."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.wire import PREFIX_DIGESTS_KEY
from tests import fake_engine
from tests.gateway_fixtures import metric, running_fake_engine, running_gateway

ASK = {"role": "user", "content": "Read the repository and list the modules that import the wire."}


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_every_chat_and_prompt_is_tokenized_by_its_rendering(fake_url: str) -> None:
    """No prompt is special: a chat is its ChatML rendering, a byte a token (the markers one
    each), and a completion prompt its bytes (token ids as they are)."""
    for content in ("hi", "local: anything", "local-long: anything", "héllo"):
        chat = {"model": "fake", "messages": [{"role": "user", "content": content}]}
        answer = httpx.post(fake_url + "/tokenize", json=chat).json()
        start, end = fake_engine.SPECIAL_TOKENS[1], fake_engine.SPECIAL_TOKENS[2]
        text = f"{start}user\n{content}{end}\n{start}assistant\n"
        assert answer["tokens"] == fake_engine.token_ids(text)
        assert answer["count"] == len(content.encode()) + 19  # 3 markers and 16 bytes
    prompt = httpx.post(fake_url + "/tokenize", json={"prompt": "abc"}).json()
    assert prompt["tokens"] == [97, 98, 99]
    ids = httpx.post(fake_url + "/tokenize", json={"prompt": [5, 6, 7]}).json()
    assert ids["tokens"] == [5, 6, 7]


def _decode(url: str, request_id: str, body: dict[str, Any], salt: str | None = None) -> Any:
    params = {"kvturn_conversation": "c"}
    payload = {"model": "fake", **body, "kv_transfer_params": params}
    if salt is not None:
        payload["cache_salt"] = salt
    response = httpx.post(
        url + "/v1/chat/completions", json=payload, headers={"x-request-id": request_id}
    )
    assert response.status_code == 200
    return response.json()


def test_a_decode_reports_only_the_whole_blocks_its_cache_holds_under_the_salt() -> None:
    with running_fake_engine() as url:
        first = _decode(url, "a", {"messages": [ASK]})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompt = first["usage"]["prompt_tokens"]
        again = _decode(url, "b", {"messages": [ASK]})
        # Whole blocks, never the prompt's last token.
        expected = (prompt - 1) // fake_engine.BLOCK_SIZE * fake_engine.BLOCK_SIZE
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == expected > 0
        other_salt = _decode(url, "c", {"messages": [ASK]}, salt="tenant-b")
        assert other_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        content = str(ASK["content"])
        edited = {"role": "user", "content": content[:20] + "X" + content[21:]}
        # Its first block ("<|im_start|>user\n" and 10 bytes) is the same, the next is not.
        assert _decode(url, "d", {"messages": [edited]})["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 16
        }
        fake_engine.clear_prefix_cache(_port(url))
        emptied = _decode(url, "e", {"messages": [ASK]})
        assert emptied["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hits = metric(url + "/metrics", "vllm:prefix_cache_hits_total")
        assert hits == expected + 16  # b and d; every other lookup found nothing
        assert metric(url + "/metrics", "vllm:prefix_cache_queries_total") == 5 * prompt


def test_a_pull_reads_only_the_verified_prefix_the_holder_still_holds() -> None:
    with running_fake_engine() as url:
        held = _decode(url, "held", {"messages": [ASK]})["kv_transfer_params"]
        assert held[PREFIX_DIGESTS_KEY] and held["remote_num_tokens"] > 64

        def pull(messages: list[Any], params: dict[str, Any]) -> int:
            body = {"model": "fake", "messages": messages, "max_tokens": 1,
                    "kv_transfer_params": {**params, "do_remote_decode": True}}  # fmt: skip
            answer = httpx.post(url + "/v1/chat/completions", json=body).json()
            return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

        following = [ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
        forged = {**held, PREFIX_DIGESTS_KEY: []}  # no proof of what it holds: nothing read
        assert pull(following, forged) == 0
        edited = [{"role": "system", "content": "new"}, *following]  # its start changed
        assert pull(edited, held) == 0
        # The whole held tokens in digest chunks (the held prompt and one reply token).
        expected = held["remote_num_tokens"] // 16 * 16
        assert pull(following, held) == expected > 64
        assert pull(following, held) == 0  # a lease is read once
        released = _decode(url, "released", {"messages": [ASK]})["kv_transfer_params"]
        httpx.delete(url + "/kvturn/leases/released")
        assert pull(following, released) == 0  # its blocks were freed


def _usage_of(sse: str) -> dict[str, Any]:
    for line in sse.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                return dict(chunk["usage"])
    raise AssertionError("no usage chunk in the stream")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("cache", ["intact", "emptied"])
def test_a_decode_local_turn_reads_the_holders_own_evidence(stream: bool, cache: str) -> None:
    """The holder's prefix cache is emptied between the turns (an engine that recomputes
    everything): the gateway still plans and, for a stream, claims the held tokens (its
    headers go before any usage), but the engine's own usage and its prefix-cache counters say
    0. With the cache intact they show what the gateway claimed, and no less."""
    with running_fake_engine() as prefill, running_fake_engine() as holder:
        config = GatewayConfig(prefill=endpoints([prefill]), decode=endpoints([holder], [holder]))
        with running_gateway(config) as gateway:
            name = f"evidence-{stream}-{cache}"
            headers = {"X-Conversation-Id": name}
            body = {"model": "fake", "messages": [ASK]}
            first = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
            assert first.headers["x-kvturn-plan"] == "recompute"
            store = gateway.app.state.gateway.store
            deadline = time.monotonic() + 5
            while (store.peek(scoped_key("", name)) or _Nothing).holder_url is None:
                assert time.monotonic() < deadline, "turn 1's KV was never recorded"
                time.sleep(0.02)
            if cache == "emptied":
                fake_engine.clear_prefix_cache(_port(holder))
            hits = metric(holder + "/metrics", "vllm:prefix_cache_hits_total")
            second = httpx.post(
                gateway.url + "/v1/chat/completions", headers=headers,
                json={**body, "stream": stream, "stream_options": {"include_usage": True}}
                if stream else body,
            )  # fmt: skip
            assert second.headers["x-kvturn-plan"] == "decode-local"
            claimed = int(second.headers["x-kvturn-reused-tokens"])
            usage = _usage_of(second.text) if stream else second.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            served = metric(holder + "/metrics", "vllm:prefix_cache_hits_total") - hits
            assert served == cached  # the engine's counters and its usage agree
            if cache == "intact":
                assert cached >= claimed > 0
            else:
                assert cached == 0
                # A stream's header is the gateway's word; a whole reply's, the engine's.
                assert claimed > 0 if stream else claimed == 0


class _Nothing:
    holder_url = None
