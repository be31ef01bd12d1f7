"""Callers authenticated, conversations bound to their tenant, requests checked at the edge:
the gateway against a fake engine, through the official openai client where a client would."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvturn import control
from kvturn.gateway.auth import ApiKeys, scoped_key, tenant_salt
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests import fake_engine
from tests.gateway_fixtures import metric, running_fake_engine, running_gateway

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
#: Long enough that a turn's KV is worth reusing (the fake engine counts a token a byte).
MESSAGES: list[Any] = [
    {"role": "user", "content": "Read the repository and list the modules that import the wire."}
]


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture(scope="module")
def gateway(fake_url: str) -> Iterator[GatewayThread]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY_A, "alpha"), (KEY_B, "beta")]),
        decode_local=False,  # the same messages again reuse by a pull
    )
    with running_gateway(config) as running:
        yield running


@pytest.fixture(scope="module")
def open_gateway(fake_url: str) -> Iterator[str]:
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as running:
        yield running.url


def _client(gateway: GatewayThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def _turn(client: openai.OpenAI, conversation_id: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, extra_headers={"X-Conversation-Id": conversation_id}
    )
    return raw.headers["x-kvturn-plan"]


# ---- authentication -------------------------------------------------------------------------


def test_every_callers_route_needs_a_valid_key(gateway: GatewayThread) -> None:
    """The ``/v1`` routes, as vLLM's ``--api-key`` guards them (the other routes' scopes:
    ``test_auth_scopes.py``)."""
    url = gateway.url
    calls = [
        ("POST", "/v1/chat/completions", {"model": "fake", "messages": MESSAGES}),
        ("POST", "/v1/completions", {"model": "fake", "prompt": "hi"}),
        ("GET", "/v1/models", None),
        ("POST", "/v1" + control.heartbeat_path("c"), {}),
        ("DELETE", "/v1" + control.release_path("c"), None),
        ("GET", "/kvturn/status", None),  # no operator keys: any caller's key
    ]
    for auth in (None, "Bearer wrong-key-0123456789abcdef", f"Basic {KEY_A}", KEY_A):
        headers = {"Authorization": auth} if auth else {}
        for method, path, body in calls:
            response = httpx.request(method, url + path, json=body, headers=headers)
            assert response.status_code == 401, (auth, path)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "sk-not-a-key-0123456789").chat.completions.create(
            model="fake", messages=MESSAGES
        )
    assert _client(gateway, KEY_A).models.list().data[0].id == "fake"


def test_a_tenant_cannot_see_renew_release_or_reuse_anothers_conversation(
    gateway: GatewayThread,
) -> None:
    alpha, beta = _client(gateway, KEY_A), _client(gateway, KEY_B)
    assert _turn(alpha, "shared-name") == "recompute"
    # Beta, knowing the id: its heartbeat and release find nothing (as for an unknown id) ...
    for client in (beta,):
        beat = client.post(
            control.heartbeat_path("shared-name"), cast_to=httpx.Response, body={}
        ).json()
        assert beat == {**beat, "known": False, "lease_remaining_s": 0.0}
        unknown = client.post(
            control.heartbeat_path("never-used"), cast_to=httpx.Response, body={}
        ).json()
        assert {k: v for k, v in beat.items() if k != "conversation_id"} == {
            k: v for k, v in unknown.items() if k != "conversation_id"
        }  # no existence oracle
        released = client.delete(control.release_path("shared-name"), cast_to=httpx.Response)
        assert released.json()["released"] is False
    # ... and its turn under that id is a first turn of its own, reusing nothing of alpha's.
    assert _turn(beta, "shared-name") == "recompute"
    store = gateway.app.state.gateway.store
    assert store.peek(scoped_key("alpha", "shared-name")) is not None
    assert store.peek(scoped_key("beta", "shared-name")) is not None
    # Alpha's conversation is untouched: its next turn still reuses its own KV.
    assert _turn(alpha, "shared-name") == "pull-reuse"
    assert _turn(beta, "shared-name") == "pull-reuse"
    assert alpha.delete(control.release_path("shared-name"), cast_to=httpx.Response).json()[
        "released"
    ]
    assert store.peek(scoped_key("beta", "shared-name")) is not None


def test_engines_get_a_cache_salt_per_tenant(gateway: GatewayThread) -> None:
    salts = {}
    for name, key in (("alpha", KEY_A), ("beta", KEY_B)):
        _client(gateway, key).chat.completions.create(model="fake", messages=MESSAGES)
        salts[name] = fake_engine.LAST_CACHE_SALT["prefill"]
        assert fake_engine.LAST_CACHE_SALT["decode"] == salts[name]
    assert salts["alpha"] and salts["beta"] and salts["alpha"] != salts["beta"]
    # A salt the client sends separates its own requests further, inside its tenant's.
    _client(gateway, KEY_A).chat.completions.create(
        model="fake", messages=MESSAGES, extra_body={"cache_salt": "mine"}
    )
    assert fake_engine.LAST_CACHE_SALT["prefill"] == f"{salts['alpha']}:mine"
    assert tenant_salt("", "mine") == "mine" and tenant_salt("", None) is None


def test_keys_parse_from_a_file_or_the_environment(tmp_path: Any) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# key tenant\n{KEY_A} alpha\n\n")
    keys = ApiKeys.load(str(keys_file), {"KVTURN_API_KEYS": f"{KEY_B}=beta"})
    assert keys.tenants == {"alpha", "beta"}
    assert keys.tenant(f"Bearer {KEY_B}") == "beta"
    assert ApiKeys().open and ApiKeys().tenant(None) == ""
    for bad in ("short beta", f"{KEY_A}", f"{KEY_A} bad/tenant"):
        with pytest.raises(ValueError):
            ApiKeys.parse(bad)


# ---- requests checked at the edge ------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": "false"}, "stream"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"messages": [1, 2]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"tools": "x"}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"stream_options": "yes"}, "stream_options"),
    ],
)
def test_fields_the_gateway_reads_are_checked(
    open_gateway: str, change: dict[str, Any], param: str
) -> None:
    body = {"model": "fake", "messages": MESSAGES, **change}
    before = fake_engine.COUNTS["prefill"]
    response = httpx.post(open_gateway + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fake_engine.COUNTS["prefill"] == before  # refused before any engine work


@pytest.mark.parametrize(
    "prompt", [None, [], [[]], [1, "a"], {"text": "x"}, [[1], "a"], True], ids=repr
)
def test_completion_prompts_are_checked(open_gateway: str, prompt: Any) -> None:
    response = httpx.post(
        open_gateway + "/v1/completions", json={"model": "fake", "prompt": prompt}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("prompt")


def test_deeply_nested_json_is_a_400_not_a_500(open_gateway: str) -> None:
    orjson_messages = json.dumps(MESSAGES)
    for depth in (300, 1000, 5000):
        nested = "[" * depth + "]" * depth
        content = f'{{"model": "fake", "messages": {orjson_messages}, "x": {nested}}}'
        response = httpx.post(open_gateway + "/v1/chat/completions", content=content.encode())
        assert response.status_code == 400, depth
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(open_gateway + "/health").status_code == 200


def test_bad_pause_headers_are_ignored(open_gateway: str) -> None:
    count = 'kvturn_client_pause_seconds_count{kind="tool"}'
    total = 'kvturn_client_pause_seconds_sum{kind="tool"}'
    before = metric(open_gateway + "/metrics", count)
    for value in ("nan", "inf", "-inf", "-5", "1e400", "ten"):
        response = httpx.post(
            open_gateway + "/v1/chat/completions",
            json={"model": "fake", "messages": MESSAGES},
            headers={"X-Kvturn-Pause-Ms": value, "X-Kvturn-Pause-Kind": "tool"},
        )
        assert response.status_code == 200, value
    assert metric(open_gateway + "/metrics", count) == before
    assert math.isfinite(metric(open_gateway + "/metrics", total))


def test_a_pause_past_a_week_counts_as_a_week(open_gateway: str) -> None:
    """``X-Kvturn-Pause-Ms: 1e308`` was forwarded to decode as it came (and fed its pause
    model); a heartbeat's ``paused_ms`` of 2**64 or more was a 500. Both count as a week."""
    from kvturn.headers import MAX_PAUSE_MS

    total = 'kvturn_client_pause_seconds_sum{kind="user"}'
    before = metric(open_gateway + "/metrics", total)
    response = httpx.post(
        open_gateway + "/v1/chat/completions",
        json={"model": "fake", "messages": MESSAGES},
        headers={
            "X-Kvturn-Pause-Ms": "1e308",
            "X-Kvturn-Pause-Kind": "user",
            "X-Conversation-Id": "absurd-pause",
        },
    )
    assert response.status_code == 200
    assert metric(open_gateway + "/metrics", total) - before == MAX_PAUSE_MS / 1000
    beat = httpx.post(
        open_gateway + "/v1/kvturn/conversations/absurd-pause/heartbeat",
        json={"pause_kind": "tool", "paused_ms": 2**64 + 1},
    )
    assert beat.status_code == 200, beat.text
    assert beat.json()["known"] is True


def test_response_ids_are_opaque(open_gateway: str) -> None:
    ids = [
        httpx.post(
            open_gateway + "/v1/chat/completions", json={"model": "fake", "messages": MESSAGES}
        ).json()["id"]
        for _ in range(3)
    ]
    # No run id shared between replies, no counter: 128 random bits each.
    assert all(re.fullmatch(r"chatcmpl-kvturn-[0-9a-f]{32}", i) for i in ids), ids
    assert len({i[-32:-8] for i in ids}) == 3


def test_the_gateway_authenticates_itself_to_the_engines(
    fake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_engine, "REQUIRED_KEY", "engine-secret")
    base = {"prefill": endpoints([fake_url]), "decode": endpoints([fake_url], [fake_url])}
    body = {"model": "fake", "messages": MESSAGES}
    for stream in (False, True):
        with running_gateway(GatewayConfig(**base, engine_api_key="engine-secret")) as gateway:
            response = httpx.post(
                gateway.url + "/v1/chat/completions", json={**body, "stream": stream}
            )
            assert response.status_code == 200, response.text
    with running_gateway(GatewayConfig(**base)) as gateway:  # without the key: refused
        assert httpx.post(gateway.url + "/v1/chat/completions", json=body).status_code == 401
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert GatewayConfig.from_env().engine_api_key == "from-env"


def test_request_bodies_held_at_once_are_bounded(fake_url: str) -> None:
    """Four concurrent 31 MB bodies once took the gateway from 54 to 673 MB: bodies being read
    or served now share a budget, and past it a request gets a 503 (the SDKs retry those)."""
    import socket
    import threading

    mib = 1024 * 1024
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        max_body_bytes=2 * mib,
        body_budget_bytes=int(2.5 * mib),
        # No conversation: decode keeps no KV, and its reply carries no digests of the 1 MiB
        # prompt (a reply of that size goes unanswered by the gateway: reported, not hidden).
        implicit_conversations=False,
    )

    def body(delay_ms: int) -> dict[str, Any]:
        padding = [{"role": "user", "content": "x" * (mib - 200)}]
        return {"model": "fake", "messages": padding, "fake_delay_ms": delay_ms}

    with running_gateway(config) as gateway:
        server_state = gateway.app.state.gateway
        url = gateway.url + "/v1/chat/completions"
        slow: list[int] = []
        held = [
            threading.Thread(
                target=lambda: slow.append(httpx.post(url, json=body(2000), timeout=60).status_code)
            )
            for _ in range(2)
        ]
        for thread in held:
            thread.start()
        time.sleep(0.8)  # both bodies read, both requests waiting on the engine (2 s)
        busy = httpx.post(url, json=body(0))
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "server_busy"
        for thread in held:
            thread.join(30)
        assert slow == [200, 200]
        assert httpx.post(url, json=body(0)).status_code == 200  # the budget was given back
        # A client that sends half a body and leaves gives its bytes back too.
        with socket.create_connection((gateway.host, gateway.port)) as raw:
            raw.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2000000\r\n"
                b"content-type: application/json\r\n\r\n" + b"{" * 500_000
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        http_server = gateway.server
        assert http_server is not None
        while http_server.body_bytes_held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http_server.body_bytes_held == 0
        assert server_state.config.body_budget_bytes == int(2.5 * mib)


def test_no_caller_without_a_key_or_with_one_can_take_the_body_budget(fake_url: str) -> None:
    """Issue #39, case 1: two connections that sent 32 MiB of body with no key and stalled
    made 59 of 61 legitimate turns fail with 503 for 60 s. A request is authenticated from its
    head: without a valid key its body is never held (it is read and dropped, and the 401
    comes as always); and each tenant may hold a share of the budget (429 past it), so one
    tenant's stalled bodies leave the others theirs."""
    import socket

    mib = 1024 * 1024
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY_A, "alpha"), (KEY_B, "beta")]),
        max_body_bytes=2 * mib,
        body_budget_bytes=5 * mib,  # two callers' shares, and room for the others
        caller_body_budget_bytes=2 * mib,
    )

    def stall(key: str | None, path: str = "/v1/chat/completions") -> socket.socket:
        """A body of almost 2 MiB, all but its last byte sent, then silence."""
        raw = socket.create_connection((gateway.host, gateway.port))
        auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
        raw.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {2 * mib - 10}\r\n".encode()
            + auth + b"content-type: application/json\r\n\r\n" + b" " * (2 * mib - 11)
        )  # fmt: skip
        return raw

    with running_gateway(config) as gateway:
        http_server = gateway.server
        assert http_server is not None
        alpha = _client(gateway, KEY_A)
        attackers = [stall(None), stall(None), stall("wrong-key"), stall(None, "/tokenize")]
        attackers += [stall(KEY_B), stall(KEY_B)]
        time.sleep(0.5)
        # No key: nothing held, but for the one body on a path that needs no key (the share of
        # callers without one); tenant beta holds at most its share.
        assert http_server.budget.by_caller.get("beta", 0) <= 2 * mib
        assert http_server.budget.held <= 2 * mib + 2 * mib
        for _ in range(5):
            assert _turn(alpha, "alpha-during-the-attack")  # served, with its plan
        # Beta's second stalled body went past its share: answered 429 (the SDKs retry it).
        answers = []
        for raw in attackers[-2:]:
            raw.settimeout(0.5)
            try:
                answers.append(raw.recv(100).split(b" ", 2)[1])
            except TimeoutError:
                answers.append(b"")
        assert sorted(answers) == [b"", b"429"], answers
        for raw in attackers:
            raw.close()
        beta = httpx.post(
            gateway.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY_B}"},
            json={"model": "fake", "messages": MESSAGES},
        )
        assert beta.status_code == 200
        deadline = time.monotonic() + 10
        while http_server.body_bytes_held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http_server.body_bytes_held == 0 and http_server.budget.by_caller == {}
        # Without a key the answer is still vLLM's 401, its body read and dropped.
        refused = httpx.post(gateway.url + "/v1/chat/completions", content=b"x" * 100_000)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "invalid_request_error"


def test_a_callers_bodies_past_its_share_get_a_429(fake_url: str) -> None:
    mib = 1024 * 1024
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY_A, "alpha")]),
        caller_body_budget_bytes=mib,
    )
    with running_gateway(config) as gateway:
        padding = [{"role": "user", "content": "x" * (mib + 10)}]
        over = httpx.post(
            gateway.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY_A}"},
            json={"model": "fake", "messages": padding},
        )
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert over.headers["retry-after"] == "1"  # the SDKs wait that long, not their backoff


@pytest.mark.parametrize("field", ["conversation_id", "prompt_cache_key"])
def test_a_conversation_id_that_would_split_the_reply_head_is_refused(
    open_gateway: str, field: str
) -> None:
    # "abc\n" passed a `^…$` check (``$`` matches before a final newline) and came back raw
    # in the X-Conversation-Id reply header: the client saw a broken head and hung.
    for bad in ("abc\n", "abc\r\nX-Injected: 1", "a\x00b"):
        body = {"model": "fake", "messages": MESSAGES, field: bad}
        response = httpx.post(open_gateway + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "conversation_id"
        assert "x-injected" not in response.headers


def test_response_headers_unsafe_to_send_are_dropped() -> None:
    from kvturn.gateway.http.exchange import header_lines

    lines = header_lines(
        [
            (b"x-ok", b"fine"),
            (b"x-bad", b"a\r\nset-cookie: x"),
            (b"x-nul", b"a\x00"),
            (b"bad name", b"v"),
        ]
    )
    assert lines == [b"x-ok: fine\r\n"]
