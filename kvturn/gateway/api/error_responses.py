"""The gateway's errors as Starlette responses (OpenAI-shaped bodies, from
:mod:`kvturn.gateway.errors`), and the app's handlers for what no route answered."""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from kvturn.gateway.errors import GatewayError, error_body

logger = logging.getLogger("kvturn.gateway")


def error_response(error: GatewayError) -> Response:
    return Response(
        orjson.dumps(error.body()),
        status_code=error.status,
        headers=error.headers(),
        media_type="application/json",
    )


async def http_error(request: Request, exc: Exception) -> Response:
    """An unknown route, or a method the route does not take."""
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = error_body(f"{request.method} {request.url.path}: {exc.detail}", kind)
    return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")


async def unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error serving %s", request.url.path)
    return error_response(GatewayError("internal gateway error"))
