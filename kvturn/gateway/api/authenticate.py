"""The authentication middleware: the caller's API key and the tenant it belongs to on the
callers' routes (vLLM's ``--api-key`` scope), an operator's key on the operators' routes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvturn.gateway.api.error_responses import error_response
from kvturn.gateway.auth import CALLER_PREFIXES, ApiKeys, OperatorKeys
from kvturn.gateway.errors import GatewayError

#: Where the authentication middleware leaves the caller's tenant in the ASGI scope.
TENANT_SCOPE_KEY = "kvturn.tenant"
#: The operators' routes (``/metrics`` joins them when the deployment guards it).
OPERATOR_PATHS = frozenset({"/kvturn/status"})
METRICS_PATH = "/metrics"


class Authenticate:
    """As vLLM's ``--api-key`` does, a path that starts with one of :data:`CALLER_PREFIXES`
    needs a caller's key (when the gateway has keys), whose tenant goes into the scope for the
    routes; OPTIONS and every other path pass (``/health``, ``/metrics``, ``/tokenize``, …),
    but for the operators' routes, which need an operator's key (or, with none set, a
    caller's)."""

    def __init__(
        self,
        app: Any,
        keys: ApiKeys,
        operator_keys: OperatorKeys | None = None,
        guard_metrics: bool = False,
    ):
        self.app = app
        self.keys = keys
        self.operator_keys = operator_keys or OperatorKeys()
        self.operator_paths = OPERATOR_PATHS | ({METRICS_PATH} if guard_metrics else set())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"]
            caller = path.startswith(CALLER_PREFIXES)
            if caller or path in self.operator_paths:
                authorization = None
                for name, value in scope["headers"]:
                    if name == b"authorization":
                        authorization = value.decode("latin-1")
                try:
                    if caller:
                        scope[TENANT_SCOPE_KEY] = self.keys.tenant(authorization)
                    elif self.operator_keys.configured:
                        self.operator_keys.check(authorization)
                    else:
                        self.keys.tenant(authorization)
                except GatewayError as error:
                    await error_response(error)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


#: The share of the body budget of callers without a key, where the gateway has keys (on the
#: paths that need none: ``/tokenize``, ``/detokenize``): one share among the tenants'.
ANONYMOUS = "\0anonymous"


def head_admission(
    keys: ApiKeys, operator_keys: OperatorKeys | None = None, guard_metrics: bool = False
) -> Callable[[str, str, list[tuple[bytes, bytes]]], GatewayError | str | None]:
    """What the gateway's own HTTP server asks of every request's head before it reads a byte
    of its body (:attr:`~kvturn.gateway.http.connection.ServerLimits.admit`): the same checks
    as :class:`Authenticate` (which still runs, and is what other ASGI servers have), so that
    a request with no valid key never holds body budget, and the tenant whose share of it the
    body takes. An open gateway has one caller: its budget is the server's."""
    operators = operator_keys or OperatorKeys()
    operator_paths = OPERATOR_PATHS | ({METRICS_PATH} if guard_metrics else set())

    def admit(
        method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> GatewayError | str | None:
        if keys.open or method == "OPTIONS":
            return None
        authorization = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
        try:
            if path.startswith(CALLER_PREFIXES):
                return keys.tenant(authorization)
            if path in operator_paths:
                if operators.configured:
                    operators.check(authorization)
                else:
                    keys.tenant(authorization)
                return ANONYMOUS
        except GatewayError as error:
            return error
        # A path that needs no key: a body with a valid key takes its tenant's share, any
        # other the share of callers without one.
        if authorization is not None:
            try:
                return keys.tenant(authorization)
            except GatewayError:
                pass
        return ANONYMOUS

    return admit
