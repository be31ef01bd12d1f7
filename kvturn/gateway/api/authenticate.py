"""The authentication middleware: the caller's API key, and the tenant it belongs to."""

from __future__ import annotations

from typing import Any

from kvturn.gateway.api.error_responses import error_response
from kvturn.gateway.auth import ApiKeys
from kvturn.gateway.errors import GatewayError

#: Where the authentication middleware leaves the caller's tenant in the ASGI scope.
TENANT_SCOPE_KEY = "kvturn.tenant"


class Authenticate:
    """Every route but ``/health`` needs a valid API key (when the gateway has keys); the
    caller's tenant goes into the scope for the routes."""

    def __init__(self, app: Any, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
            try:
                scope[TENANT_SCOPE_KEY] = self.keys.tenant(authorization)
            except GatewayError as error:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
