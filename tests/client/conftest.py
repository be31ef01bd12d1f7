"""Fixtures for kvturn.client tests: a stand-in gateway, and one base URL fixture for tests
that can run against the real gateway.

``KVTURN_TEST_BASE_URL`` unset: the stand-in. ``KVTURN_TEST_BASE_URL=local-pair``: the gateway
of the session's real 1P1D pair (the ``local_pair`` fixture, started on first use). Any other
value: a running gateway's ``.../v1``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import httpx
import pytest
from kvturn_stub_gateway import MODEL, ServerThread, StubGateway

#: The adapters' tests need their extras (``agents``, ``langchain``), and two tests run the real
#: gateway or its planner (the ``gateway`` extra); an environment without them (the openai
#: compatibility check and the client-only install, ``make client-compat``) leaves those out.
collect_ignore = [
    test
    for test, package in (
        ("test_adapter_openai_agents.py", "agents"),
        ("test_adapter_langchain.py", "langgraph"),
        ("test_client_on_gateway.py", "tenacity"),
        ("test_stub_gateway.py", "tenacity"),
    )
    if importlib.util.find_spec(package) is None
]


def _serve(stub: StubGateway) -> Iterator[StubGateway]:
    with ServerThread(stub.app()) as server:
        stub.url = f"http://127.0.0.1:{server.port}/v1"
        yield stub


@pytest.fixture(scope="session")
def _stub_session() -> Iterator[StubGateway]:
    yield from _serve(StubGateway(control_api=True))


@pytest.fixture(scope="session")
def _plain_session() -> Iterator[StubGateway]:
    yield from _serve(StubGateway(control_api=False))


@pytest.fixture
def stub(_stub_session: StubGateway) -> StubGateway:
    """The stand-in gateway, its records cleared; tests may read and set its state."""
    _stub_session.reset()
    return _stub_session


@pytest.fixture
def plain_server(_plain_session: StubGateway) -> StubGateway:
    """A plain OpenAI-compatible server: no kvturn control API."""
    _plain_session.reset()
    return _plain_session


LOCAL_PAIR = "local-pair"


@pytest.fixture
def gateway_kind(request: pytest.FixtureRequest) -> str:
    """``stand-in``, ``engines`` (the session's real pair) or ``env`` (KVTURN_TEST_BASE_URL).

    Modules parametrize it indirectly to run against both the stand-in and the real gateway.
    """
    explicit = getattr(request, "param", None)
    if explicit is not None:
        return str(explicit)
    configured = os.environ.get("KVTURN_TEST_BASE_URL")
    if configured == LOCAL_PAIR:
        return "engines"
    return "env" if configured else "stand-in"


@pytest.fixture
def base_url(request: pytest.FixtureRequest, gateway_kind: str) -> str:
    """Where adapter tests send traffic: the stand-in, or a real gateway."""
    if gateway_kind == "engines":
        return str(request.getfixturevalue("local_pair").gateway_url).rstrip("/")
    if gateway_kind == "env":
        return os.environ["KVTURN_TEST_BASE_URL"].rstrip("/")
    stub: StubGateway = request.getfixturevalue("stub")
    return stub.url


@pytest.fixture
def real_gateway(gateway_kind: str) -> bool:
    """Whether ``base_url`` is a real gateway (whose model may not call tools at all)."""
    return gateway_kind != "stand-in"


@pytest.fixture
def model_name(base_url: str, real_gateway: bool) -> str:
    """The first model the server at ``base_url`` lists."""
    if not real_gateway:
        return MODEL
    answer = httpx.get(f"{base_url}/models", timeout=30).json()
    return str(answer["data"][0]["id"])
