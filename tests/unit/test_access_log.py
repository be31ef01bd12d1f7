"""The access log (one line per request, on by default, off by a switch), the gateway's log
level and its JSON format (python-json-logger), against a fake engine."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvturn import control
from kvturn.gateway.api import access_log
from kvturn.gateway.api.access_log import ACCESS_LOGGER, _path, conversation_digest
from kvturn.gateway.auth import ApiKeys, scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.cli import build_parser
from kvturn.gateway.server import GatewayThread, log_handler
from tests.gateway_fixtures import running_fake_engine, running_gateway

KEY = "sk-access-log-0123456789abcdef"
CONVERSATION = "chat-private-name-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _config(fake_url: str, **settings: Any) -> GatewayConfig:
    return GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        api_keys=ApiKeys([(KEY, "alpha")]),
        decode_local=False,  # the same messages again reuse by a pull
        **settings,
    )


@pytest.fixture(scope="module")
def gateway(fake_url: str) -> Iterator[GatewayThread]:
    with running_gateway(_config(fake_url)) as running:
        yield running


def _chat(url: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": "fake",
        "messages": [
            {
                "role": "user",
                "content": "Read the repository and list the modules that import the wire.",
            }
        ],
        "stream": stream,
    }
    headers = {**AUTH, "X-Conversation-Id": CONVERSATION}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _access(caplog: pytest.LogCaptureFixture, count: int) -> list[logging.LogRecord]:
    """The first ``count`` access lines (written once a reply has gone: wait for them)."""
    deadline = time.monotonic() + 5
    while True:
        records = [r for r in caplog.records if r.name == ACCESS_LOGGER.name]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.01)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    names = ("method", "path", "status", "duration_ms", "tenant", "conversation", "plan",
             "plan_reason", "reused_tokens", "ttft_ms")  # fmt: skip
    return {n: getattr(record, n) for n in names if hasattr(record, n)}


def test_a_turns_line_says_plan_reason_reuse_tenant_and_a_digest_never_the_id(
    gateway: GatewayThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER.name)
    first = _chat(gateway.url)
    second = _chat(gateway.url, stream=True)
    assert second.headers["x-kvturn-plan"] == "pull-reuse"
    records = _access(caplog, 2)
    assert len(records) == 2
    digest = conversation_digest("alpha", CONVERSATION)
    assert digest != conversation_digest("beta", CONVERSATION) and len(digest) == 12
    for record, reply, streamed in ((records[0], first, False), (records[1], second, True)):
        fields = _fields(record)
        assert fields.pop("duration_ms") >= 0
        ttft = fields.pop("ttft_ms", None)
        assert (ttft is not None) == streamed
        assert fields == {
            "method": "POST",
            "path": "/v1/chat/completions",
            "status": 200,
            "tenant": "alpha",
            "conversation": digest,
            "plan": reply.headers["x-kvturn-plan"],
            "plan_reason": reply.headers["x-kvturn-plan-reason"],
            "reused_tokens": int(reply.headers["x-kvturn-reused-tokens"]),
        }
        message = record.getMessage()
        assert message.startswith("POST /v1/chat/completions 200 ")
        assert f"conversation={digest}" in message and f"plan={fields['plan']}" in message
        assert CONVERSATION not in message
    assert records[1].reused_tokens > 0  # type: ignore[attr-defined]
    assert 0 <= records[1].ttft_ms <= records[1].duration_ms  # type: ignore[attr-defined]


def test_other_routes_say_method_path_status_and_duration(
    gateway: GatewayThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER.name)
    assert httpx.get(gateway.url + "/health").status_code == 200
    assert httpx.get(gateway.url + "/v1/models").status_code == 401  # no key: logged too
    beat = "/v1" + control.heartbeat_path(CONVERSATION)
    assert httpx.post(gateway.url + beat, json={}, headers=AUTH).status_code == 200
    assert httpx.post(gateway.url + beat, json={}).status_code == 401
    health, refused, heartbeat, anonymous = (_fields(r) for r in _access(caplog, 4))
    for fields in (health, refused, heartbeat, anonymous):
        assert fields.pop("duration_ms") >= 0
    assert health == {"method": "GET", "path": "/health", "status": 200}
    assert refused == {"method": "GET", "path": "/v1/models", "status": 401}
    # A heartbeat's path names the conversation: by its digest, never its id.
    digest = conversation_digest("alpha", CONVERSATION)
    assert heartbeat == {
        "method": "POST",
        "path": "/v1" + control.heartbeat_path(digest),
        "status": 200,
        "tenant": "alpha",
        "conversation": digest,
    }
    assert CONVERSATION not in anonymous["path"] and anonymous["status"] == 401
    assert CONVERSATION not in "".join(r.getMessage() for r in _access(caplog, 4))


def test_the_access_log_turns_off_and_costs_nothing_when_off(
    fake_url: str, gateway: GatewayThread, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    logged: list[Any] = []
    monkeypatch.setattr(access_log, "_log", lambda *args: logged.append(args))
    # The logger off for INFO (e.g. --log-level warning): no line is made.
    caplog.set_level(logging.WARNING, logger=ACCESS_LOGGER.name)
    assert _chat(gateway.url).status_code == 200
    time.sleep(0.1)
    assert logged == []
    # Switched off (--no-access-log): no middleware at all.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER.name)
    with running_gateway(_config(fake_url, access_log=False)) as quiet:
        assert _chat(quiet.url).status_code == 200
        assert httpx.get(quiet.url + "/health").status_code == 200
        time.sleep(0.1)
    assert logged == [] and not [r for r in caplog.records if r.name == ACCESS_LOGGER.name]


def test_json_lines_parse_with_every_field_as_a_key(
    gateway: GatewayThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER.name)
    stream = io.StringIO()
    handler = log_handler("json", stream)
    ACCESS_LOGGER.addHandler(handler)
    try:
        _chat(gateway.url, stream=True)
        httpx.get(gateway.url + "/health")
        _access(caplog, 2)
    finally:
        ACCESS_LOGGER.removeHandler(handler)
    turn, health = (json.loads(line) for line in stream.getvalue().splitlines())
    assert {"time", "level", "logger", "message"} <= turn.keys()
    assert (turn["level"], turn["logger"]) == ("INFO", "kvturn.access")
    assert turn["tenant"] == "alpha" and turn["conversation"] == conversation_digest(
        "alpha", CONVERSATION
    )
    assert turn["plan"] == "pull-reuse" and isinstance(turn["reused_tokens"], int)
    assert isinstance(turn["ttft_ms"], float) and turn["status"] == 200
    assert {k: health[k] for k in ("method", "path", "status")} == {
        "method": "GET",
        "path": "/health",
        "status": 200,
    }


_LOG_SCRIPT = """
import logging, sys
from kvturn.gateway.server import configure_logging
configure_logging(sys.argv[1], sys.argv[2])
logging.getLogger("kvturn.gateway").debug("a debug line")
logging.getLogger("kvturn.access").info("GET /health 200", extra={"status": 200})
logging.getLogger("some.library").info("a library's info")
logging.getLogger("some.library").warning("a library's warning")
"""


def _logged(level: str, log_format: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _LOG_SCRIPT, level, log_format],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stderr.splitlines()


def test_log_level_and_format_as_kvturn_serve_sets_them() -> None:
    lines = [json.loads(line) for line in _logged("debug", "json")]
    assert [(x["logger"], x["level"], x["message"]) for x in lines] == [
        ("kvturn.gateway", "DEBUG", "a debug line"),
        ("kvturn.access", "INFO", "GET /health 200"),
        ("some.library", "WARNING", "a library's warning"),  # others: WARNING and up
    ]
    assert lines[1]["status"] == 200
    text = _logged("warning", "text")  # the access log is at INFO: silent here
    assert len(text) == 1 and text[0].endswith("WARNING some.library: a library's warning")


def test_log_flags_and_variables_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvturn.gateway.ops.serve import serve_settings

    for name in ("KVTURN_ACCESS_LOG", "KVTURN_LOG_LEVEL", "KVTURN_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    base = ["serve", "--prefill", "http://p", "--decode", "http://d"]
    config = serve_settings(build_parser().parse_args(base))[0]
    assert (config.access_log, config.log_level, config.log_format) == (True, "info", "text")
    argv = [*base, "--no-access-log", "--log-level", "debug", "--log-format", "json"]
    config = serve_settings(build_parser().parse_args(argv))[0]
    assert (config.access_log, config.log_level, config.log_format) == (False, "debug", "json")
    monkeypatch.setenv("KVTURN_ACCESS_LOG", "off")
    monkeypatch.setenv("KVTURN_LOG_FORMAT", "JSON")
    config = serve_settings(build_parser().parse_args(base))[0]
    assert (config.access_log, config.log_format) == (False, "json")
    assert serve_settings(build_parser().parse_args([*base, "--access-log"]))[0].access_log
    up = build_parser().parse_args(["up", "--no-access-log", "--log-level", "warning"])
    assert (up.access_log, up.log_level, up.log_format) == (False, "warning", None)
    with pytest.raises(ValueError, match="log_level"):
        GatewayConfig(log_level="verbose")


def test_a_conversation_is_one_digest_in_its_turns_and_its_heartbeats() -> None:
    # An id that travels encoded (in a header, in a path) is digested as the id it is.
    odd = "team a / chat 7"
    assert conversation_digest("alpha", odd) == scoped_key("alpha", odd)[2:14]
    scope = {
        "path": "/v1/kvturn/conversations/team a / chat 7/heartbeat",
        "raw_path": b"/v1/kvturn/conversations/team%20a%20%2F%20chat%207/heartbeat",
    }
    path, digest = _path(scope, "alpha")
    assert digest == conversation_digest("alpha", odd)
    assert path == f"/v1/kvturn/conversations/{digest}/heartbeat"
