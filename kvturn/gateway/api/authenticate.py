"""The authentication middleware: the caller's API key and the tenant it belongs to on the
callers' routes (vLLM's ``--api-key`` scope), an operator's key on the operators' routes; and
the same check made of a request's head by the gateway's own HTTP server, before any of its
body is read (:func:`head_admission`)."""

from __future__ import annotations

import contextlib
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
#: The share of the body budget of callers without a key, where the gateway has keys (on the
#: paths that need none: ``/tokenize``, ``/detokenize``): one share among the tenants'.
ANONYMOUS = "\0anonymous"


class Gate:
    """Which key a request needs, as vLLM's ``--api-key`` decides it: a path that starts with
    one of :data:`CALLER_PREFIXES` needs a caller's key (when the gateway has keys); OPTIONS
    and every other path pass (``/health``, ``/metrics``, ``/tokenize``, …), but for the
    operators' routes, which need an operator's key (or, with none set, a caller's)."""

    def __init__(
        self, keys: ApiKeys, operator_keys: OperatorKeys | None = None, guard_metrics: bool = False
    ):
        self.keys = keys
        self.operator_keys = operator_keys or OperatorKeys()
        self.operator_paths = OPERATOR_PATHS | ({METRICS_PATH} if guard_metrics else set())

    def caller(self, method: str, path: str, authorization: str | None) -> str | None:
        """The tenant of a request on a caller's route (``None``: no caller's route); raises
        :class:`~kvturn.gateway.errors.GatewayError` for a key the route refuses."""
        if method == "OPTIONS":
            return None
        if path.startswith(CALLER_PREFIXES):
            return self.keys.tenant(authorization)
        if path in self.operator_paths:
            if self.operator_keys.configured:
                self.operator_keys.check(authorization)
            else:
                self.keys.tenant(authorization)
        return None

    def admit(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
        """:attr:`~kvturn.gateway.http.connection.ServerLimits.admit`: the error a refused
        request gets, or the tenant whose share of the body budget its body takes (a valid
        key's on any path; :data:`ANONYMOUS` without one). An open gateway has one caller:
        its budget is the server's (``None``)."""
        if self.keys.open:
            return None
        authorization = _authorization(headers)
        try:
            tenant = self.caller(method, path, authorization)
        except GatewayError as error:
            return error
        if tenant is None and authorization is not None:
            with contextlib.suppress(GatewayError):  # a wrong key: the share without one
                tenant = self.keys.tenant(authorization)
        return ANONYMOUS if tenant is None else tenant


def head_admission(
    keys: ApiKeys, operator_keys: OperatorKeys | None = None, guard_metrics: bool = False
) -> Callable[[str, str, list[tuple[bytes, bytes]]], GatewayError | str | None]:
    """What the gateway's own HTTP server asks of every request's head before it reads a byte
    of its body: :meth:`Gate.admit`. :class:`Authenticate` still runs (it is what other ASGI
    servers have), so that a request with no valid key never holds body budget."""
    return Gate(keys, operator_keys, guard_metrics).admit


class Authenticate:
    """The ASGI middleware of :class:`Gate`: a caller's tenant goes into the scope for the
    routes; a refused key gets its OpenAI-shaped error and reaches nothing."""

    def __init__(
        self,
        app: Any,
        keys: ApiKeys,
        operator_keys: OperatorKeys | None = None,
        guard_metrics: bool = False,
    ):
        self.app = app
        self.gate = Gate(keys, operator_keys, guard_metrics)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            try:
                tenant = self.gate.caller(
                    scope["method"], scope["path"], _authorization(scope["headers"])
                )
            except GatewayError as error:
                await error_response(error)(scope, receive, send)
                return
            if tenant is not None:
                scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The (last) ``Authorization`` header, as vLLM's middleware reads it."""
    authorization = None
    for name, value in headers:
        if name == b"authorization":
            authorization = value.decode("latin-1")
    return authorization
