"""Issue #39: no tenant can hold more of the gateway than its share of requests in flight and
of engine requests, and a batch, streamed or not, opens at most a window of engine requests.
Through the gateway's own server in front of the fake engine (tests/fake_engine.py), which
counts the engine requests it serves at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from kvturn.gateway.auth import ApiKeys, scoped_key
from kvturn.gateway.batches import BATCH_WINDOW
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests import fake_engine
from tests.gateway_fixtures import running_fake_engine, running_gateway

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
CHAT = "/v1/chat/completions"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _config(fake_url: str, **limits: Any) -> GatewayConfig:
    return GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY_A, "alpha"), (KEY_B, "beta")]),
        **limits,
    )


def _post(gateway: GatewayThread, key: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **kw.pop("headers", {})}
    return httpx.post(gateway.url + kw.pop("path", CHAT), json=body, headers=headers,
                      timeout=kw.pop("timeout", 60), **kw)  # fmt: skip


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": MESSAGES, **extra}


def _in_background(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def _wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _held(gateway: GatewayThread, tenant: str) -> tuple[int, int]:
    """The requests and engine requests ``tenant`` has in flight at the gateway."""
    callers = gateway.app.state.gateway.callers
    return callers.requests.get(tenant, 0), callers.engine_requests.get(tenant, 0)


def _assert_rate_limited(response: httpx.Response) -> None:
    """An OpenAI-shaped 429 that says when to retry."""
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["code"] == "rate_limit_exceeded"
    assert isinstance(error["message"], str) and "retry" in error["message"]
    assert int(response.headers["retry-after"]) >= 1


def test_a_tenants_requests_past_its_share_get_a_429_and_others_are_served(
    fake_url: str,
) -> None:
    """Alpha has its 2 requests in flight (each waits 1 s on the engine): its third is refused
    at once, before it reaches an engine or the conversation table; beta, at the same moment,
    is served."""
    with running_gateway(_config(fake_url, caller_requests_in_flight=2)) as gateway:
        slow = [_in_background(lambda: _post(gateway, KEY_A, _chat(fake_delay_ms=1000)))
                for _ in range(2)]  # fmt: skip
        # Both at the engine (their prefills wait 1 s there; their decodes come after).
        _wait_until(lambda: fake_engine.COUNTS["in_flight"] == 2, "alpha's never reached it")
        assert _held(gateway, "alpha")[0] == 2
        engine_requests = fake_engine.COUNTS["prefill"] + fake_engine.COUNTS["decode"]
        in_engine = fake_engine.COUNTS["in_flight"]
        refused = _post(gateway, KEY_A, _chat(), headers={"X-Conversation-Id": "refused-1"})
        _assert_rate_limited(refused)
        assert fake_engine.COUNTS["in_flight"] == in_engine  # it reached no engine
        assert fake_engine.COUNTS["prefill"] + fake_engine.COUNTS["decode"] == engine_requests
        streamed = _post(gateway, KEY_A, _chat(stream=True))
        _assert_rate_limited(streamed)  # a streamed request is refused the same way
        assert _post(gateway, KEY_B, _chat()).status_code == 200  # beta, meanwhile
        assert _held(gateway, "alpha")[0] == 2  # the refused ones held nothing
        for thread, answers in slow:
            thread.join(30)
            assert answers[0].status_code == 200
        store = gateway.app.state.gateway.store
        assert store.peek(scoped_key("alpha", "refused-1")) is None  # no table entry made
        assert _held(gateway, "alpha") == (0, 0)
        assert _post(gateway, KEY_A, _chat()).status_code == 200


def test_every_way_a_request_ends_gives_its_place_back(fake_url: str) -> None:
    """Refused, invalid, abandoned before its reply, abandoned mid-stream, streamed to its
    end: after each, the tenant holds nothing, and can have its 2 requests in flight again."""
    with running_gateway(_config(fake_url, caller_requests_in_flight=2)) as gateway:

        def settled() -> None:
            _wait_until(lambda: _held(gateway, "alpha") == (0, 0), "alpha's places never came back")

        def two_at_once() -> None:
            both = [_in_background(lambda: _post(gateway, KEY_A, _chat(fake_delay_ms=300)))
                    for _ in range(2)]  # fmt: skip
            _wait_until(lambda: _held(gateway, "alpha")[0] == 2, "two never in flight at once")
            # At the limit: refused, while beta is served.
            _assert_rate_limited(_post(gateway, KEY_A, _chat()))
            assert _post(gateway, KEY_B, _chat()).status_code == 200
            for thread, answers in both:
                thread.join(30)
                assert answers[0].status_code == 200
            settled()

        two_at_once()  # refused ones (the third) give nothing back: they held nothing
        two_at_once()
        # Invalid: a 400, from the gateway's checks.
        assert _post(gateway, KEY_A, {"model": "fake", "messages": []}).status_code == 400
        assert _post(gateway, KEY_A, {"model": "fake", "prompt": [[]]},
                     path="/v1/completions").status_code == 400  # fmt: skip
        settled()
        # Abandoned before its reply: its client gives up while the engine still works.
        with pytest.raises(httpx.ReadTimeout):
            _post(gateway, KEY_A, _chat(fake_delay_ms=3000), timeout=0.3)
        settled()
        # Abandoned mid-stream: the client reads a chunk and leaves (the engine's stream
        # would last 4 s).
        body = _chat(stream=True, fake_slow_stream=200)
        headers = {"authorization": f"Bearer {KEY_A}"}
        with httpx.stream("POST", gateway.url + CHAT, json=body, headers=headers) as response:
            assert response.status_code == 200
            next(response.iter_lines())
        settled()
        # Streamed to its end; a streamed batch to its end.
        assert _post(gateway, KEY_A, _chat(stream=True, fake_slow_stream=3)).status_code == 200
        batch = {"model": "fake", "prompt": ["a", "b", "c"], "stream": True}
        assert _post(gateway, KEY_A, batch, path="/v1/completions").status_code == 200
        settled()
        two_at_once()


def test_a_streamed_reply_holds_its_place_until_its_stream_ends(fake_url: str) -> None:
    """A streamed reply is in flight until its stream has been relayed: with one in flight
    (its head sent, its stream still coming), the tenant's next request is refused."""
    with running_gateway(_config(fake_url, caller_requests_in_flight=1)) as gateway:
        body = _chat(stream=True, fake_slow_stream=50)  # one chunk per 20 ms: 1 s
        headers = {"authorization": f"Bearer {KEY_A}"}
        with httpx.stream("POST", gateway.url + CHAT, json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)
            _assert_rate_limited(_post(gateway, KEY_A, _chat()))
            assert _post(gateway, KEY_B, _chat()).status_code == 200
            assert list(lines)[-2] == "data: [DONE]"
        _wait_until(lambda: _held(gateway, "alpha") == (0, 0), "the stream's place never freed")
        assert _post(gateway, KEY_A, _chat()).status_code == 200


def _completions(response: httpx.Response) -> list[int]:
    """The choice indexes of a (non-streamed) completion reply, in order."""
    assert response.status_code == 200, response.text
    return [choice["index"] for choice in response.json()["choices"]]


def test_one_tenants_batches_cannot_take_every_engine_request(fake_url: str) -> None:
    """Alpha may hold 4 engine requests: its batch of 8 prompts runs 4 at a time (not
    ``BATCH_WINDOW``), answered whole and in order; while that batch holds all 4, alpha's next
    request is refused, and beta's is served."""
    config = _config(fake_url, caller_engine_requests_in_flight=4)
    batch = {"model": "fake", "prompt": [f"p{i}" for i in range(8)], "fake_delay_ms": 300}
    with running_gateway(config) as gateway:
        fake_engine.COUNTS["peak_in_flight"] = 0
        assert _completions(_post(gateway, KEY_A, batch, path="/v1/completions")) == list(range(8))
        # At most its 4 (fewer while the gateway's loop runs late: batches then yield,
        # gateway/congestion.py).
        assert 1 <= fake_engine.COUNTS["peak_in_flight"] <= 4
        thread, answers = _in_background(
            lambda: _post(gateway, KEY_A, batch, path="/v1/completions")
        )
        _wait_until(lambda: _held(gateway, "alpha") == (1, 4), "the batch never took its window")
        _assert_rate_limited(_post(gateway, KEY_A, _chat()))
        assert _post(gateway, KEY_B, _chat()).status_code == 200
        thread.join(30)
        assert _completions(answers[0]) == list(range(8))
        _wait_until(lambda: _held(gateway, "alpha") == (0, 0), "the batch's window never freed")
        assert _post(gateway, KEY_A, _chat()).status_code == 200


def test_a_deployment_caps_the_prompts_of_one_request(fake_url: str) -> None:
    """``caller_batch_prompts`` 4: a batch of 4 is served, one of 5 gets a 400 naming
    ``prompt`` and reaches no engine; nothing stays held for it."""
    config = _config(fake_url, caller_batch_prompts=4)
    with running_gateway(config) as gateway:
        four = {"model": "fake", "prompt": [f"p{i}" for i in range(4)]}
        assert _completions(_post(gateway, KEY_A, four, path="/v1/completions")) == list(range(4))
        served = fake_engine.COUNTS["prefill"]
        five = {"model": "fake", "prompt": [f"p{i}" for i in range(5)]}
        refused = _post(gateway, KEY_A, five, path="/v1/completions")
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "prompt" and "at most 4 prompts" in error["message"]
        assert fake_engine.COUNTS["prefill"] == served
        assert _held(gateway, "alpha") == (0, 0)
    with pytest.raises(ValueError, match="caller_batch_prompts"):
        GatewayConfig(caller_batch_prompts=257)
    with pytest.raises(ValueError, match="caller_batch_prompts"):
        GatewayConfig(caller_batch_prompts=0)


def test_a_streamed_batch_opens_at_most_a_window_of_engine_requests(fake_url: str) -> None:
    """A streamed batch of 40 prompts opened 40 engine requests at once; now at most
    ``BATCH_WINDOW``. The reply is what one engine streams for the batch: every prompt's
    chunks numbered by prompt, one usage chunk summing them, one [DONE]."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    prompts = 40
    body = {"model": "fake", "prompt": [f"p{i}" for i in range(prompts)], "stream": True,
            "stream_options": {"include_usage": True}, "fake_delay_ms": 300}  # fmt: skip
    with running_gateway(config) as gateway:
        fake_engine.COUNTS["peak_in_flight"] = 0
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        # At most a window (fewer while the loop runs late: gateway/congestion.py; the window
        # reached is tested in tests/unit/test_batches.py).
        assert 1 <= fake_engine.COUNTS["peak_in_flight"] <= BATCH_WINDOW
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    data = [orjson.loads(event) for event in events[:-1]]
    indexes = [choice["index"] for chunk in data for choice in chunk["choices"]]
    assert sorted(set(indexes)) == list(range(prompts))
    assert indexes == sorted(indexes)  # relayed prompt after prompt
    assert len({chunk["id"] for chunk in data}) == 1
    counted = sum(len(fake_engine.prompt_ids({"prompt": prompt})) for prompt in body["prompt"])
    assert data[-1]["choices"] == [] and data[-1]["usage"]["prompt_tokens"] == counted


def test_limits_are_set_by_flag_variable_or_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from kvturn.gateway.ops.cli import build_parser
    from kvturn.gateway.ops.serve import serve_settings

    monkeypatch.setenv("KVTURN_CALLER_REQUESTS_IN_FLIGHT", "7")
    monkeypatch.setenv("KVTURN_CALLER_ENGINE_REQUESTS_IN_FLIGHT", "0")
    config = GatewayConfig.from_env()
    assert (config.caller_requests_in_flight, config.caller_engine_requests_in_flight) == (7, 0)
    monkeypatch.delenv("KVTURN_CALLER_REQUESTS_IN_FLIGHT")
    monkeypatch.delenv("KVTURN_CALLER_ENGINE_REQUESTS_IN_FLIGHT")
    deployment = tmp_path / "kvturn.toml"
    deployment.write_text(
        '[gateway]\ncaller_requests_in_flight = 9\n[[prefill]]\nurl = "http://p"\n'
        '[[decode]]\nurl = "http://d"\n'
    )
    args = build_parser().parse_args(
        ["serve", "--config", str(deployment), "--caller-engine-requests-in-flight", "3"]
    )
    config = serve_settings(args)[0]
    assert (config.caller_requests_in_flight, config.caller_engine_requests_in_flight) == (9, 3)
    up = build_parser().parse_args(
        ["up", "--caller-requests-in-flight", "5", "--caller-engine-requests-in-flight", "6",
         "--caller-batch-prompts", "16"]
    )  # fmt: skip
    assert (up.caller_requests_in_flight, up.caller_engine_requests_in_flight) == (5, 6)
    assert up.caller_batch_prompts == 16
    monkeypatch.setenv("KVTURN_CALLER_BATCH_PROMPTS", "8")
    assert GatewayConfig.from_env().caller_batch_prompts == 8
    defaults = GatewayConfig()
    assert defaults.caller_requests_in_flight == defaults.caller_engine_requests_in_flight == 512
    with pytest.raises(ValueError, match="caller_requests_in_flight"):
        GatewayConfig(caller_requests_in_flight=-1)


def test_no_limit_when_set_to_zero(fake_url: str) -> None:
    """0: no limit, as the gateway's other zero settings mean."""
    config = _config(fake_url, caller_requests_in_flight=0, caller_engine_requests_in_flight=0)
    with running_gateway(config) as gateway:
        slow = [_in_background(lambda: _post(gateway, KEY_A, _chat(fake_delay_ms=300)))
                for _ in range(3)]  # fmt: skip
        _wait_until(lambda: _held(gateway, "alpha")[0] == 3, "alpha's requests never arrived")
        assert _post(gateway, KEY_A, _chat()).status_code == 200
        for thread, answers in slow:
            thread.join(30)
            assert answers[0].status_code == 200
