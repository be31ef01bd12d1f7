"""A tiny HTTP server inside the decode engine process that answers the gateway: the
connector's side of the control channel whose routes, secret and bodies :mod:`kvturn.wire`
declares.

It runs on a daemon thread of the engine-core process (where the scheduler-side connector
lives), on loopback by default, and serves the engine's :class:`LeaseTable`, its NIXL identity
and (push mode, decode) its pushes' arrivals. Every route but
:data:`~kvturn.wire.HEALTH_PATH` needs the shared secret when the engine has one, checked from
the request's head before any body is read; anything else gets 401, changes nothing, and ends
the connection. Connections are bounded (:data:`MAX_CONNECTIONS`) and closed when silent
(:data:`IDLE_TIMEOUT_S`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ValidationError

from kvturn.connector.leases import Lease, LeaseTable
from kvturn.wire import (
    CLAIM_ROUTE,
    CONTROL_AUTH_HEADER,
    CONTROL_SECRET_ENV,
    DRAIN_PATH,
    EXPIRES_IN_KEY,
    HEALTH_PATH,
    IDENTITY_PATH,
    INSECURE_CONTROL_CONFIG,
    LEASE_ROUTE,
    LEASES_PATH,
    PUSHES_ROUTE,
    RENEW_ROUTE,
    RETAINED_ROUTE,
    WAIT_MS_QUERY,
    WAKE_PATH,
    Acknowledged,
    ControlError,
    EngineIdentity,
    LeaseGone,
    LeaseReleased,
    PushState,
    PushStateName,
    RenewRequest,
    RenewResponse,
    WakeRequest,
    claimed_flag,
    match_control_route,
    presented_secret,
)

logger = logging.getLogger(__name__)

_MAX_WAIT_S = 5.0
_MAX_BODY = 64 * 1024


def lease_answer(lease: Lease, now: float) -> dict[str, Any]:
    """A lease's params as the gateway gets them: the deadline as a duration and, for the
    prefill's own expiry check, on this process's clock (where NIXL stamps it too)."""
    params = dict(lease.params)
    if params.get("remote_blocks_expiry_time") is not None:
        params["remote_blocks_expiry_time"] = lease.expires_at
    params[EXPIRES_IN_KEY] = round(lease.expires_at - now, 3)
    return params


def control_secret(secret: str | None, extra: dict[str, Any]) -> str | None:
    """The control channel's shared secret (``secret``, from
    :data:`~kvturn.wire.CONTROL_SECRET_ENV`). Without one, anyone who reaches the control port
    could release or hold every lease: the engine refuses to start unless its connector config
    says so (:data:`~kvturn.wire.INSECURE_CONTROL_CONFIG`; ``kvturn engine
    --insecure-control``), and then warns."""
    if secret:
        return secret
    if not extra.get(INSECURE_CONTROL_CONFIG):
        raise RuntimeError(
            f"kvturn: {CONTROL_SECRET_ENV} is not set: refusing to open the control channel to "
            "anyone who can reach its port (set the secret the gateway shares, or "
            f"{INSECURE_CONTROL_CONFIG}: true in kv_connector_extra_config to run it open)"
        )
    logger.warning("kvturn: %s is not set: the control channel is open", CONTROL_SECRET_ENV)
    return None


class ControlServer:
    """Serve a :class:`LeaseTable` over HTTP on ``host:port`` from a daemon thread."""

    def __init__(
        self,
        leases: LeaseTable,
        host: str,
        port: int,
        secret: str | None = None,
        on_call: Callable[[], None] | None = None,
        identity: EngineIdentity | None = None,
        on_expect: Callable[[float], None] | None = None,
    ):
        self.leases = leases
        #: Push mode, decode: a :class:`~kvturn.connector.push.PushArrivals`.
        self.pushes: Any = None
        #: Set by a drain (:data:`~kvturn.wire.DRAIN_PATH`): the engine takes no new turns.
        self.draining = threading.Event()
        handler = _make_handler(
            leases,
            secret.encode() if secret else None,
            on_call,
            identity,
            lambda: self.pushes,
            on_expect,
            self.draining,
        )
        self._httpd = _BoundedServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvturn-control", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> ControlServer:
        self._thread.start()
        logger.info("kvturn control server listening on port %d", self.port)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


#: Connections served at once (a thread each, ~27 KB of memory idle: 2,000 took 53 MB); past
#: it a new one is closed at once (the gateway's call fails, and its turn falls back). Every
#: gateway worker keeps a pool per decode, mostly idle and closed after 3 s; a turn's calls
#: take one at a time, the longest a reply's publication wait (up to 5 s).
MAX_CONNECTIONS = 512
#: A connection silent this long (mid-request, or idle between requests) is closed.
IDLE_TIMEOUT_S = 30.0


class _BoundedServer(ThreadingHTTPServer):
    """:class:`ThreadingHTTPServer`, its threads bounded: 2,000 idle connections were 2,000
    threads (+53 MB), all still open after 30 s (issue #39, case 7)."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _make_handler(
    leases: LeaseTable,
    secret: bytes | None,
    on_call: Callable[[], None] | None,
    identity: EngineIdentity | None,
    pushes: Callable[[], Any],
    on_expect: Callable[[float], None] | None,
    draining: threading.Event,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_TIMEOUT_S
        # The handler writes an answer's head and body in two sends; with Nagle's algorithm
        # the body waits for the peer's ACK of the head, which a keep-alive peer delays (40 ms
        # on Linux). Measured before: every call after the first on a kept connection took
        # 42-44 ms, the first 3.6 ms (benchmarks/isolation.py found it).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            route, key, query = match_control_route(self.path)
            if route == HEALTH_PATH:
                self._send(200, Acknowledged(draining=draining.is_set()))
            elif not self._authorized():
                return
            elif route == LEASES_PATH:
                self._send(200, leases.stats())
            elif route == IDENTITY_PATH:
                self._send(200, identity.model_dump() if identity is not None else {})
            elif route == RETAINED_ROUTE and key is not None:
                wait_s = self._wait_s(query)
                if wait_s is not None:
                    self._answer(key, leases.get(key, wait_s=wait_s))
            elif route == PUSHES_ROUTE and key is not None:
                wait_s = self._wait_s(query)
                arrivals = pushes()
                if wait_s is not None:
                    state: PushStateName = (
                        "unknown" if arrivals is None else arrivals.wait(key, wait_s)
                    )
                    self._send(200, PushState(state=state))
            else:
                self._send(404, ControlError(error="not found"))

        def do_POST(self) -> None:
            route, key, _ = match_control_route(self.path)
            # The secret first, from the head: a caller without it gets no body read.
            if not self._authorized():
                return
            body = self._body()
            if body is None:
                return
            if on_call is not None:
                on_call()
            if route == WAKE_PATH:
                try:
                    within_ms = WakeRequest.model_validate(body).within_ms
                except ValidationError:  # a number too large for a float: no promise
                    within_ms = None
                if on_expect is not None and within_ms is not None:
                    on_expect(within_ms / 1000)
                self._send(200, Acknowledged())
            elif route == DRAIN_PATH:
                if not draining.is_set():
                    logger.warning("kvturn: draining: the gateways send this engine no new turns")
                draining.set()
                self._send(200, Acknowledged(draining=True))
            elif route == CLAIM_ROUTE and key is not None:
                self._answer(key, leases.claim(key))
            elif route == RENEW_ROUTE and key is not None:
                try:
                    asked = RenewRequest.model_validate(body)
                except ValidationError:
                    error = "lease_s and paused_ms must be finite numbers >= 0"
                    self._send(400, ControlError(error=error))
                    return
                paused_s = None if asked.paused_ms is None else asked.paused_ms / 1000
                lease = leases.renew(key, asked.lease_s, asked.pause_kind, paused_s)
                if lease is None:
                    self._answer(key, None)
                else:
                    left = round(lease.expires_at - leases.clock(), 3)
                    self._send(200, RenewResponse(expires_in_s=left))
            else:
                self._send(404, ControlError(error="not found"))

        def do_DELETE(self) -> None:
            route, key, query = match_control_route(self.path)
            if not self._authorized() or self._body() is None:
                return
            if on_call is not None:
                on_call()
            if route == LEASE_ROUTE and key is not None:
                released = leases.release(key, end_claim=claimed_flag(query))
                self._send(200, LeaseReleased(released=released))
            elif route == DRAIN_PATH:  # a drain called off: it takes turns again
                draining.clear()
                self._send(200, Acknowledged(draining=False))
            else:
                self._send(404, ControlError(error="not found"))

        # ---- helpers ----

        def _wait_s(self, query: dict[str, list[str]]) -> float | None:
            try:
                wait_ms = float(query.get(WAIT_MS_QUERY, ["0"])[0])
            except ValueError:
                wait_ms = math.nan
            if not math.isfinite(wait_ms):  # nan once parked a thread for good
                self._send(400, ControlError(error=f"{WAIT_MS_QUERY} must be a finite number"))
                return None
            return max(min(wait_ms / 1000, _MAX_WAIT_S), 0.0)

        def _authorized(self) -> bool:
            if secret is None:
                return True
            given = presented_secret(self.headers.get(CONTROL_AUTH_HEADER, ""))
            if given is not None and hmac.compare_digest(given.encode(), secret):
                return True
            self.close_connection = True  # its body, unread, must not be taken as a request
            self._send(
                401, ControlError(error="the kvturn control channel needs the shared secret")
            )
            return False

        def _body(self) -> dict[str, Any] | None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > _MAX_BODY:
                self.close_connection = True  # its body, unread, must not be taken as a request
                self._send(400, ControlError(error="bad Content-Length"))
                return None
            raw = self.rfile.read(length) if length else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self._send(400, ControlError(error="the body must be a JSON object"))
                return None
            return body

        def _answer(self, key: str, lease: Lease | None) -> None:
            if lease is None:
                self._send(404, LeaseGone(reason=leases.gone_reason(key)))
            else:
                self._send(200, lease_answer(lease, leases.clock()))

        def _send(self, status: int, body: BaseModel | dict[str, Any]) -> None:
            if isinstance(body, BaseModel):
                body = body.model_dump(by_alias=True, exclude_none=True)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("control: " + format, *args)

    return Handler
