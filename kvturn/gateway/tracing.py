"""OpenTelemetry spans for a turn and its phases, through the ``opentelemetry-api`` package.

A gateway traces (:func:`tracer_for`) with the tracer provider its configuration names (an
embedding application's, a test's), else the process's own SDK provider if one is set (by
``opentelemetry-instrument``), else, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, one it sets up that exports OTLP over HTTP,
configured by the standard ``OTEL_*`` variables (``pip install 'kvturn[otel]'``). Otherwise it
does not trace: the turn carries no tracer, and every helper here is a constant or a no-op.

One trace per turn: ``kvturn.turn`` (a server span, child of the caller's ``traceparent`` if it
sent one) until its reply is sent; inside it ``kvturn.plan`` (how the previous KV is used),
``kvturn.prefill`` (the prefill request, a pull of the history included), ``kvturn.decode``
(decode's request until its reply ends) and, for a streamed P/D turn, ``kvturn.transfer``
(from decode's request to its first token: decode reading the KV prefill computed). The
engines get the current span's context in their ``traceparent``, so vLLM's own spans (``
--otlp-traces-endpoint``) join the trace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

_OFF: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
_PARENT_HEADERS = (b"traceparent", b"tracestate")
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracer_for(provider: trace.TracerProvider | None = None) -> trace.Tracer | None:
    """The tracer a gateway traces with, or None: it does not (see the module's docstring)."""
    if provider is not None:
        return provider.get_tracer("kvturn.gateway")
    if isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    ):
        if not any(os.environ.get(name) for name in _ENDPOINT_ENV):
            return None
        _install_otlp_provider()
    return trace.get_tracer("kvturn.gateway")


def _install_otlp_provider() -> None:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise RuntimeError(
            f"{' or '.join(_ENDPOINT_ENV)} is set, but the OpenTelemetry SDK is not installed: "
            "pip install 'kvturn[otel]'"
        ) from error
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "kvturn-gateway"}
    provider = TracerProvider(resource=Resource.create(named))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def start_turn(
    tracer: trace.Tracer | None, path: str, raw_headers: Iterable[tuple[bytes, bytes]]
) -> trace.Span | None:
    """The turn's span, child of the caller's trace context (ASGI headers), or None (off)."""
    if tracer is None:
        return None
    carrier = {k.decode(): v.decode("latin-1") for k, v in raw_headers if k in _PARENT_HEADERS}
    parent = propagate.extract(carrier) if carrier else None
    return tracer.start_span(
        "kvturn.turn", context=parent, kind=trace.SpanKind.SERVER, attributes={"http.route": path}
    )


def current(span: trace.Span | None) -> contextlib.AbstractContextManager[Any]:
    """Make ``span`` the current span for the block (nothing, if None)."""
    return _OFF if span is None else trace.use_span(span, end_on_exit=False)


def end_turn(span: trace.Span | None, status: int, headers: Mapping[str, str]) -> None:
    """End the turn's span with its reply's status and the plan the gateway chose."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    for name, value in headers.items():
        if name.startswith("X-Kvturn-"):
            span.set_attribute("kvturn." + name[len("X-Kvturn-") :].lower(), value)
    if status >= 500:
        span.set_status(trace.StatusCode.ERROR)
    span.end()


def phase(tracer: trace.Tracer | None, name: str) -> contextlib.AbstractContextManager[Any]:
    """A span for one phase of the current turn, current for the block (nothing when off)."""
    return _OFF if tracer is None else tracer.start_as_current_span(name)


class DecodeSpans:
    """``kvturn.decode`` for one decode request, and ``kvturn.transfer`` until its first token
    for a P/D turn; both children of the current span. Ended by :meth:`end` (a whole reply,
    or a stream's end, however it ends)."""

    __slots__ = ("context", "decode", "transfer")

    def __init__(self, tracer: trace.Tracer, transfer: bool):
        self.decode = tracer.start_span("kvturn.decode")
        self.context = trace.set_span_in_context(self.decode)
        self.transfer = (
            tracer.start_span("kvturn.transfer", context=self.context) if transfer else None
        )

    def first_token(self) -> None:
        if self.transfer is not None:
            self.transfer.end()
            self.transfer = None

    def end(self, status: int | None = None) -> None:
        self.first_token()
        if status is not None:
            self.decode.set_attribute("http.response.status_code", status)
        self.decode.end()


def start_decode(tracer: trace.Tracer | None, transfer: bool) -> DecodeSpans | None:
    return None if tracer is None else DecodeSpans(tracer, transfer)


def inject(headers: dict[str, str], context: otel_context.Context | None = None) -> None:
    """Put the current span's (or ``context``'s) trace context into an engine request's
    ``headers``."""
    propagate.inject(headers, context=context)
