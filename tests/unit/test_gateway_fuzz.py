"""Property-based fuzzing of the real gateway (on the fake engine): whatever the body, headers
or control-API path, the answer is never a 5xx and never a traceback, every error is
OpenAI-shaped, and the gateway stays healthy. A bounded budget keeps CI quick
(``KVTURN_FUZZ_EXAMPLES`` raises it for a longer run)."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvturn.gateway.auth import ApiKeys
from kvturn.gateway.config import GatewayConfig, endpoints
from tests.gateway_fixtures import running_fake_engine, running_gateway

KEY = "sk-fuzz-0123456789abcdef"
EXAMPLES = int(os.environ.get("KVTURN_FUZZ_EXAMPLES", "150"))
#: Where a long run (``benchmarks/fuzz_gateway.py``) wants the statuses it saw, as JSON.
REPORT = os.environ.get("KVTURN_FUZZ_REPORT")
#: (test, status) -> how many answers.
SEEN: Counter[str] = Counter()
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with running_fake_engine() as fake:
        config = GatewayConfig(
            prefill=endpoints([fake]),
            decode=endpoints([fake], [fake]),
            api_keys=ApiKeys([(KEY, "fuzz")]),
            max_body_bytes=256 * 1024,
        )
        with running_gateway(config) as running:
            yield running.url


@pytest.fixture(scope="module")
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


# ---- what requests are made of ---------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | _json},
    optional={"content": st.text(max_size=40) | _json, "tool_call_id": _json, "name": _json},
)
_tool = st.fixed_dictionaries(
    {"type": st.just("function") | _json},
    optional={"function": st.fixed_dictionaries({"name": st.text(max_size=10) | _json})},
)
# (h11, under httpx, refuses header values with whitespace at either end)
_ids = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140).map(str.strip)
_FIELDS: dict[str, Any] = {
    "model": st.just("fake") | _json,
    "stream": st.booleans() | _json,
    "max_tokens": st.integers(min_value=-5, max_value=2**65) | _json,
    "max_completion_tokens": st.integers(min_value=-5, max_value=64) | _json,
    "n": st.integers(min_value=-1, max_value=200) | _json,
    "tools": st.lists(_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | _json,
    "stream_options": st.just({"include_usage": True}) | _json,
    "temperature": _json,
    "conversation_id": _ids | _json,
    "prompt_cache_key": _ids | _json,
    "cache_salt": _json,
    "kv_transfer_params": _json,
}
_chat_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _json}, optional=_FIELDS
)
_completion_body = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=30)
        | st.lists(st.text(max_size=10), max_size=3)
        | st.lists(st.integers(min_value=-5, max_value=70000), max_size=5)
        | st.lists(st.lists(st.integers(min_value=0, max_value=300), max_size=3), max_size=3)
        | _json
    },
    optional=_FIELDS,
)
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(
    str.strip
)
_headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Conversation-Id": _ids,
        "X-Kvturn-Turn-Id": _header_text,
        "X-Kvturn-Pause-Ms": st.sampled_from(["nan", "inf", "-1", "1e400", "12", ""])
        | _header_text,
        "X-Kvturn-Pause-Kind": st.sampled_from(["tool", "user"]) | _header_text,
    },
)


def _assert_sane(response: httpx.Response) -> None:
    SEEN[f"{response.request.method} {response.request.url.path[:24]} {response.status_code}"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error


@pytest.fixture(autouse=True)
def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.WARNING, logger="kvturn"):
        yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# ---- properties ----------------------------------------------------------------------------------


@FUZZ
@given(body=_chat_body, headers=_headers)
def test_chat_requests_never_5xx(http: httpx.Client, body: Any, headers: dict[str, str]) -> None:
    _assert_sane(
        http.post(
            "/v1/chat/completions",
            content=json.dumps(body),
            headers={**headers, "Authorization": f"Bearer {KEY}"},
        )
    )


@FUZZ
@given(body=_completion_body, headers=_headers)
def test_completion_requests_never_5xx(
    http: httpx.Client, body: Any, headers: dict[str, str]
) -> None:
    _assert_sane(
        http.post(
            "/v1/completions",
            content=json.dumps(body),
            headers={**headers, "Authorization": f"Bearer {KEY}"},
        )
    )


@FUZZ
@given(
    raw=st.binary(max_size=300) | _json.map(lambda v: json.dumps(v).encode()),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    auth=st.sampled_from([f"Bearer {KEY}", "Bearer nope", "", KEY]) | _header_text,
)
def test_any_bytes_any_key_never_5xx(http: httpx.Client, raw: bytes, path: str, auth: str) -> None:
    _assert_sane(http.post(path, content=raw, headers={"Authorization": auth}))


@FUZZ
@given(
    conversation=st.text(max_size=150),
    method=st.sampled_from(["POST", "DELETE", "GET", "PUT"]),
    action=st.sampled_from(["/heartbeat", "", "/x"]),
    body=_json,
    authorized=st.booleans(),
)
def test_control_api_never_5xx(
    http: httpx.Client, conversation: str, method: str, action: str, body: Any, authorized: bool
) -> None:
    path = "/v1/kvturn/conversations/" + quote(conversation, safe="") + action
    headers = {"Authorization": f"Bearer {KEY}"} if authorized else {}
    _assert_sane(http.request(method, path, content=json.dumps(body), headers=headers))


def test_gateway_is_healthy_after_the_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    if REPORT:
        Path(REPORT).write_text(json.dumps({"examples": EXAMPLES, "answers": dict(SEEN)}))
