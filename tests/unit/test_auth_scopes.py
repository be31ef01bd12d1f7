"""Which key each route wants: the callers' routes are exactly those vLLM's ``--api-key``
guards (checked against vLLM's own middleware, read from the installed wheel), the operators'
routes (``/kvturn/status``, ``/metrics`` when guarded) take an operator's key, and every other
route is open, as on an engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvturn import control
from kvturn.gateway.api.authenticate import Authenticate
from kvturn.gateway.auth import ApiKeys, OperatorKeys
from kvturn.gateway.config import GatewayConfig, endpoints
from tests.gateway_fixtures import (
    free_port,
    running_fake_engine,
    running_gateway,
    vllm_auth_middleware,
)

KEY = "sk-caller-0123456789abcdef"
OPERATOR = "sk-operator-0123456789abcdef"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
HEARTBEAT = "/v1" + control.heartbeat_path("scoped")
RELEASE = "/v1" + control.release_path("scoped")

#: (method, path, body) of every kind of route the gateway serves, and some it does not.
CALLERS = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "fake", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/responses/resp_unknown", None),
    ("POST", HEARTBEAT, {}),
    ("DELETE", RELEASE, None),
    ("GET", "/v1/no-such-route", None),  # a guarded prefix: 401 before 404, as vLLM
    ("GET", "/v2/anything", None),
]
OPEN = [
    ("GET", "/health", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/no-such-route", None),
]
STATUS = ("GET", "/kvturn/status", None)
METRICS = ("GET", "/metrics", None)


async def _reached(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _status(app: Any, method: str, path: str, authorization: str | None) -> int:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers,
             "query_string": b""}  # fmt: skip
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return int(sent[0]["status"])


def test_the_callers_scope_is_vllms() -> None:
    """Every method, path and header: kvturn refuses (401) exactly what vLLM's ``--api-key``
    refuses (vllm/entrypoints/serve/middleware/authenticate.py: a path that starts with
    ``/v1``, ``/v2``, ``/inference`` or ``/cohere``; OPTIONS never)."""
    vllm = vllm_auth_middleware()(_reached, tokens=[KEY])
    kvturn = Authenticate(_reached, ApiKeys([(KEY, "alpha")]))
    paths = [p for _, p, _ in CALLERS + OPEN] + [
        "/v1", "/v1x", "/inference/v1/generate", "/cohere/v2/chat", "/metrics", "/ping",
        "/load", "/", "/pooling", "/score",
    ]  # fmt: skip
    auths = [None, f"Bearer {KEY}", f"bearer {KEY}", "Bearer sk-wrong-0123456789abcdef",
             f"Basic {KEY}", KEY]  # fmt: skip
    for method in ("GET", "POST", "DELETE", "OPTIONS"):
        for path in paths:
            for auth in auths:
                want = _status(vllm, method, path, auth)
                assert _status(kvturn, method, path, auth) == want, (method, path, auth)
    assert _status(kvturn, "GET", "/v1/models", None) == 401
    assert _status(kvturn, "OPTIONS", "/v1/models", None) == 299


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _statuses(url: str, calls: list[Any], key: str | None) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return {
        f"{method} {path}": httpx.request(
            method, url + path, json=body, headers=headers, timeout=30
        ).status_code
        for method, path, body in calls
    }


@pytest.mark.parametrize("operators", [False, True], ids=["no-operator-keys", "operator-keys"])
@pytest.mark.parametrize("guard_metrics", [False, True], ids=["metrics-open", "metrics-guarded"])
def test_each_route_wants_its_scopes_key(
    fake_url: str, operators: bool, guard_metrics: bool
) -> None:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY, "alpha")]),
        operator_keys=OperatorKeys([OPERATOR] if operators else []),
        guard_metrics=guard_metrics,
    )
    with running_gateway(config) as gateway:
        url = gateway.url
        # The callers' routes: 401 without the caller's key (an operator's key is none).
        for key in (None, OPERATOR):
            assert set(_statuses(url, CALLERS, key).values()) == {401}, key
        served = _statuses(url, CALLERS, KEY)
        assert 401 not in served.values(), served
        assert served["GET /v1/no-such-route"] == 404
        # The open routes answer alike with a key or without.
        anonymous = _statuses(url, OPEN, None)
        assert 401 not in anonymous.values(), anonymous
        assert anonymous == _statuses(url, OPEN, KEY)
        assert anonymous["GET /health"] == 200
        # The operators' routes: the operator's key; with no operator keys, a caller's.
        operator_routes = [STATUS, METRICS] if guard_metrics else [STATUS]
        allowed = OPERATOR if operators else KEY
        refused = KEY if operators else OPERATOR
        for key in (None, refused):
            assert set(_statuses(url, operator_routes, key).values()) == {401}, key
        assert set(_statuses(url, operator_routes, allowed).values()) == {200}
        if not guard_metrics:  # vLLM's scope: a Prometheus scrape needs no key
            assert _statuses(url, [METRICS], None) == {"GET /metrics": 200}


@pytest.mark.parametrize("guard_metrics", [False, True], ids=["metrics-open", "metrics-guarded"])
def test_metrics_on_a_listen_address_of_their_own(fake_url: str, guard_metrics: bool) -> None:
    """``metrics_port``: /metrics is served there (the same counts, the same key rule) and
    no longer on the gateway's port, which tenants reach (issue 39: scrapes)."""
    metrics_port = free_port()
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY, "alpha")]),
        operator_keys=OperatorKeys([OPERATOR]),
        guard_metrics=guard_metrics,
        metrics_port=metrics_port,
    )
    with running_gateway(config) as gateway:
        turn = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                          headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert turn.status_code == 200
        for key in (None, KEY, OPERATOR):
            assert _statuses(gateway.url, [METRICS], key) == {"GET /metrics": 404}
        scrapes = f"http://127.0.0.1:{metrics_port}"
        allowed = _statuses(scrapes, [METRICS], OPERATOR)
        assert allowed == {"GET /metrics": 200}
        anonymous = _statuses(scrapes, [METRICS], None)
        assert anonymous == {"GET /metrics": 401 if guard_metrics else 200}
        # Only the scrape is served there.
        assert _statuses(scrapes, [CALLERS[0]], KEY) == {"POST /v1/chat/completions": 404}
        assert _statuses(scrapes, [STATUS], OPERATOR) == {"GET /kvturn/status": 404}
        text = httpx.get(scrapes + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
        assert 'kvturn_turns_total{plan="recompute"} 1.0' in text.text


def test_operator_keys_alone_guard_the_status_route_of_an_open_gateway(fake_url: str) -> None:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        operator_keys=OperatorKeys([OPERATOR]),
    )
    with running_gateway(config) as gateway:
        assert _statuses(gateway.url, [STATUS], None) == {"GET /kvturn/status": 401}
        assert _statuses(gateway.url, [STATUS], OPERATOR) == {"GET /kvturn/status": 200}
        assert _statuses(gateway.url, [CALLERS[2], METRICS], None) == {
            "GET /v1/models": 200,
            "GET /metrics": 200,
        }


def test_operator_keys_load_from_a_file_the_environment_and_the_deployment_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvturn.gateway.ops.cli import build_parser
    from kvturn.gateway.ops.serve import serve_settings

    for name in ("KVTURN_OPERATOR_KEYS", "KVTURN_OPERATOR_KEYS_FILE", "KVTURN_GUARD_METRICS"):
        monkeypatch.delenv(name, raising=False)
    keys = tmp_path / "operator-keys"
    keys.write_text(f"# operators\n{OPERATOR}\n")
    loaded = OperatorKeys.load(str(keys), {"KVTURN_OPERATOR_KEYS": "sk-second-0123456789abc"})
    for key in (OPERATOR, "sk-second-0123456789abc"):
        loaded.check(f"Bearer {key}")
    with pytest.raises(ValueError, match="16 characters"):
        OperatorKeys.parse("short")
    assert not OperatorKeys().configured

    deployment = tmp_path / "deploy.toml"
    deployment.write_text(
        f'[gateway]\nguard_metrics = true\n[auth]\noperator_keys_file = "{keys}"\n'
        '[[prefill]]\nurl = "http://p:8000"\n[[decode]]\nurl = "http://d:8000"\n'
    )
    config, *_ = serve_settings(build_parser().parse_args(["serve", "--config", str(deployment)]))
    assert config.guard_metrics and config.operator_keys.configured
    config.operator_keys.check(f"Bearer {OPERATOR}")
    # Variables and flags as for every setting.
    monkeypatch.setenv("KVTURN_OPERATOR_KEYS", "sk-from-env-0123456789abc")
    monkeypatch.setenv("KVTURN_GUARD_METRICS", "off")
    config = GatewayConfig.from_env(prefill=endpoints(["http://p"]))
    assert not config.guard_metrics
    config.operator_keys.check("Bearer sk-from-env-0123456789abc")
    args = build_parser().parse_args(
        ["serve", "--config", str(deployment), "--guard-metrics", "on"]
    )
    assert serve_settings(args)[0].guard_metrics
