"""OpenTelemetry: one trace per turn, its phases as spans, the caller's ``traceparent`` as its
parent and the engines' ``traceparent`` as children of it (the SDK's in-memory exporter as the
collector); no tracing, and so nothing carried but the caller's own context, when off."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvturn.gateway import tracing
from kvturn.gateway.config import GatewayConfig, endpoints
from tests import fake_engine
from tests.gateway_fixtures import running_fake_engine, running_gateway

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture
def traced(fake_url: str) -> Iterator[tuple[str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        tracer_provider=provider,
    )
    with running_gateway(config) as running:
        yield running.url, exporter


def _turn(url: str, stream: bool, conversation: str) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    headers = {"traceparent": TRACEPARENT, "X-Conversation-Id": conversation}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_is_one_trace_under_the_callers_with_its_phases(
    traced: tuple[str, InMemorySpanExporter], stream: bool
) -> None:
    url, exporter = traced
    assert _turn(url, stream, f"traced-{stream}").status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    expected = {"kvturn.turn", "kvturn.plan", "kvturn.prefill", "kvturn.decode"}
    if stream:
        expected.add("kvturn.transfer")  # decode's request until its first token
    assert set(spans) == expected
    turn = spans["kvturn.turn"]
    assert turn.parent is not None and f"{turn.parent.span_id:016x}" == PARENT_SPAN
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {TRACE_ID}
    for name in ("kvturn.plan", "kvturn.prefill", "kvturn.decode"):
        assert spans[name].parent.span_id == turn.context.span_id, name
    if stream:
        assert spans["kvturn.transfer"].parent.span_id == spans["kvturn.decode"].context.span_id
    assert turn.attributes["kvturn.plan"] == "recompute"
    assert turn.attributes["http.response.status_code"] == 200
    # The engines' requests are children of the gateway's spans, in the caller's trace.
    for role, parent in (("prefill", "kvturn.prefill"), ("decode", "kvturn.decode")):
        sent = fake_engine.LAST_HEADERS[role]["traceparent"]
        assert sent == f"00-{TRACE_ID}-{spans[parent].context.span_id:016x}-01", role


def test_one_trace_per_turn(traced: tuple[str, InMemorySpanExporter]) -> None:
    url, exporter = traced
    for _ in range(3):
        assert _turn(url, False, "three-turns").status_code == 200
    turns = [s for s in exporter.get_finished_spans() if s.name == "kvturn.turn"]
    assert len(turns) == 3
    assert len({s.context.span_id for s in turns}) == 3


def test_without_a_provider_or_an_endpoint_nothing_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.tracer_for(None) is None
    assert tracing.start_turn(None, "/v1/chat/completions", []) is None
    assert tracing.start_decode(None, transfer=True) is None
