"""The gateway app whole, for other ASGI servers to run: ``benchmarks/gateway_overhead.py
--servers`` measures uvicorn (httptools and h11) and granian serving it beside the gateway's own
HTTP server. Configured from ``KVTURN_*`` variables, as ``kvturn serve`` is."""

from __future__ import annotations

from starlette.applications import Starlette

from kvturn.gateway.app import create_app
from kvturn.gateway.config import GatewayConfig


def app() -> Starlette:
    """An app factory (``uvicorn --factory``, ``granian --factory``)."""
    return create_app(GatewayConfig.from_env())
