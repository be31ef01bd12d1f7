"""The gateway's ASGI app: OpenAI-compatible endpoints in front of prefill and decode pools.
:func:`create_app` puts together the routes (:mod:`.api`), the access log and authentication
middleware, the error handlers and the lifespan that starts and stops the
:class:`~.instance.Gateway`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from kvturn import control
from kvturn.gateway.api import routes
from kvturn.gateway.api.access_log import AccessLog
from kvturn.gateway.api.authenticate import Authenticate
from kvturn.gateway.api.error_responses import http_error, unexpected_error
from kvturn.gateway.api.turn import TURN_PATHS, TurnEndpoint
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.instance import Gateway
from kvturn.gateway.responses.translate import RESPONSES_PATH


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    gateway: Gateway = app.state.gateway
    await gateway.start()
    try:
        yield
    finally:
        await gateway.stop()


def create_app(config: GatewayConfig) -> Starlette:
    """The gateway as an ASGI app (``app.state.gateway`` is its :class:`~.instance.Gateway`);
    the gateway's own server (:mod:`kvturn.gateway.http.server`) runs it, lifespan included."""
    gateway = Gateway(config)
    conversations = "/v1" + control.CONVERSATIONS_PATH
    turn = TurnEndpoint(gateway)
    app = Starlette(
        routes=[
            # The turns first: the router tries routes in order.
            *(Route(path, turn, methods=["POST"]) for path in sorted(TURN_PATHS)),
            Route(
                RESPONSES_PATH + "/{response_id}", routes.stored_response, methods=["GET", "DELETE"]
            ),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/version", routes.engine_route, methods=["GET"]),
            Route("/tokenize", routes.engine_route, methods=["POST"]),
            Route("/detokenize", routes.engine_route, methods=["POST"]),
            # On a listen address of its own where one is set (create_metrics_app).
            *([] if config.metrics_port else [Route("/metrics", routes.metrics, methods=["GET"])]),
            Route("/kvturn/status", routes.status, methods=["GET"]),
            # ``:path``: an id holds any character, ``/`` too (sent as %2F, which the server
            # decodes before routing: kvturn.control.path_segment).
            Route(
                conversations + "/{conversation_id:path}/heartbeat",
                routes.heartbeat,
                methods=["POST"],
            ),
            Route(conversations + "/{conversation_id:path}", routes.release, methods=["DELETE"]),
        ],
        lifespan=_lifespan,
        # With /metrics elsewhere, the path here is a route like no other (404 to anyone).
        middleware=_middleware(config, config.guard_metrics and not config.metrics_port),
        exception_handlers=_EXCEPTION_HANDLERS,
    )
    app.state.gateway = gateway
    return app


def create_metrics_app(gateway_app: Starlette) -> Starlette:
    """``/metrics`` of the gateway ``gateway_app`` serves, alone (``metrics_port``): the same
    counts, keys and access log; no lifespan (the gateway's own app runs it)."""
    gateway: Gateway = gateway_app.state.gateway
    app = Starlette(
        routes=[Route("/metrics", routes.metrics, methods=["GET"])],
        middleware=_middleware(gateway.config, gateway.config.guard_metrics),
        exception_handlers=_EXCEPTION_HANDLERS,
    )
    app.state.gateway = gateway
    return app


_EXCEPTION_HANDLERS = {
    HTTPException: http_error,  # unknown route, wrong method
    Exception: unexpected_error,
}


def _middleware(config: GatewayConfig, guard_metrics: bool) -> list[Middleware]:
    return [
        # The access log outermost: a request refused for its key is logged too.
        *([Middleware(AccessLog)] if config.access_log else []),
        Middleware(
            Authenticate,
            keys=config.api_keys,
            operator_keys=config.operator_keys,
            guard_metrics=guard_metrics,
        ),
    ]
