"""A tiny HTTP server inside the decode engine process that answers the gateway.

It runs on a daemon thread of the engine-core process (where the scheduler-side connector
lives), on loopback by default. Every route but ``/kvturn/health`` needs
``Authorization: Bearer <secret>`` when the engine has a secret (``KVTURN_CONTROL_SECRET`` in
its environment, which ``kvturn up`` generates and gives to the engines and the gateway alike);
anything else gets 401 and changes nothing. Routes (``{key}`` is the X-Request-Id the gateway
sent with the turn):

``GET /kvturn/retained/{key}?wait_ms=N``
    The live lease's params (what a prefill needs to read the blocks) and ``expires_in_s``,
    waiting up to N ms for the turn to finish; 404 with ``reason`` if there is none.
``POST /kvturn/leases/{key}/claim``
    A prefill is about to read the lease: it is held until the read ends. Answers the params,
    with ``remote_blocks_expiry_time`` brought up to the lease's current deadline; 404 with
    ``reason`` (``expired``, ``reclaimed``, ``released``, ``superseded``, ``read``, ``unknown``).
``POST /kvturn/leases/{key}/renew``
    Body ``{"lease_s": s, "pause_kind": "tool"|"user", "paused_ms": n}``: extend a live lease.
    Answers ``{"expires_in_s": s}``, or 404 with ``reason``.
``DELETE /kvturn/leases/{key}[?claimed=1]``
    Free the blocks now (``claimed=1``: the caller's own claim is over, its read ended).
``POST /kvturn/wake``
    A turn is on its way to this engine: stop pacing idle steps (see
    :class:`~kvturn.connector.engine_pacing.IdlePacer`). Every POST and DELETE also does this.
    Body ``{"within_ms": n}`` (optional): the request itself arrives within ``n`` ms (at most
    1000); step often until it does.
``GET /kvturn/identity``
    The engine's NIXL identity: ``engine_id``, ``side_channel_host``, ``side_channel_port``,
    ``tp_size``, ``pp_size``, ``transfer_mode`` (``pull``/``push``). A push-mode gateway names
    the prefill to the decode that registers its blocks with it before prefill has answered.
``GET /kvturn/pushes/{key}?wait_ms=N``
    Push mode, decode: ``{"state": "arrived"}`` once the KV a prefill pushed for the request has
    arrived (waiting up to N ms for it), else ``awaiting`` (registered, nothing written yet) or
    ``unknown`` (not scheduled yet, or not a push request).
``GET /kvturn/leases``
    Counters: live leases, blocks they hold, retained, renewed, claimed, ended by reason.
``GET /kvturn/health``
    ``{"ok": true}``.
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
from urllib.parse import parse_qs, unquote, urlsplit

from kvturn.connector.leases import Lease, LeaseTable

logger = logging.getLogger(__name__)

_MAX_WAIT_S = 5.0
_MAX_BODY = 64 * 1024


def lease_answer(lease: Lease, now: float) -> dict[str, Any]:
    """A lease's params as the gateway gets them: the deadline as a duration and, for the
    prefill's own expiry check, on this process's clock (where NIXL stamps it too)."""
    params = dict(lease.params)
    if params.get("remote_blocks_expiry_time") is not None:
        params["remote_blocks_expiry_time"] = lease.expires_at
    params["expires_in_s"] = round(lease.expires_at - now, 3)
    return params


class ControlServer:
    """Serve a :class:`LeaseTable` over HTTP on ``host:port`` from a daemon thread."""

    def __init__(
        self,
        leases: LeaseTable,
        host: str,
        port: int,
        secret: str | None = None,
        on_call: Callable[[], None] | None = None,
        identity: dict[str, Any] | None = None,
        on_expect: Callable[[float], None] | None = None,
    ):
        self.leases = leases
        #: Push mode, decode: a :class:`~kvturn.connector.push.PushArrivals`.
        self.pushes: Any = None
        handler = _make_handler(
            leases,
            secret.encode() if secret else None,
            on_call,
            dict(identity or {}),
            lambda: self.pushes,
            on_expect,
        )
        self._httpd = ThreadingHTTPServer((host, port), handler)
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


def _make_handler(
    leases: LeaseTable,
    secret: bytes | None,
    on_call: Callable[[], None] | None,
    identity: dict[str, Any],
    pushes: Callable[[], Any],
    on_expect: Callable[[float], None] | None,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            parts, query = self._route()
            if parts == ["kvturn", "health"]:
                self._send(200, {"ok": True})
            elif not self._authorized():
                return
            elif parts == ["kvturn", "leases"]:
                self._send(200, leases.stats())
            elif parts == ["kvturn", "identity"]:
                self._send(200, identity)
            elif len(parts) == 3 and parts[:2] == ["kvturn", "retained"]:
                wait_s = self._wait_s(query)
                if wait_s is not None:
                    self._answer(parts[2], leases.get(parts[2], wait_s=wait_s))
            elif len(parts) == 3 and parts[:2] == ["kvturn", "pushes"]:
                wait_s = self._wait_s(query)
                arrivals = pushes()
                if wait_s is not None:
                    state = "unknown" if arrivals is None else arrivals.wait(parts[2], wait_s)
                    self._send(200, {"state": state})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            parts, _ = self._route()
            body = self._body()
            if body is None or not self._authorized():
                return
            if on_call is not None:
                on_call()
            if parts == ["kvturn", "wake"]:
                within_ms = body.get("within_ms")
                if on_expect is not None and isinstance(within_ms, (int, float)):
                    on_expect(float(within_ms) / 1000)
                self._send(200, {"ok": True})
            elif len(parts) == 4 and parts[:2] == ["kvturn", "leases"] and parts[3] == "claim":
                self._answer(parts[2], leases.claim(parts[2]))
            elif len(parts) == 4 and parts[:2] == ["kvturn", "leases"] and parts[3] == "renew":
                try:
                    lease_s = float(body.get("lease_s", 0))
                    kind = body.get("pause_kind")
                    paused_ms = body.get("paused_ms")
                    paused_s = None if paused_ms is None else float(paused_ms) / 1000
                    finite = math.isfinite(lease_s) and (
                        paused_s is None or math.isfinite(paused_s)
                    )
                except (TypeError, ValueError, OverflowError):
                    finite = False
                if not finite or lease_s < 0 or (paused_s is not None and paused_s < 0):
                    self._send(400, {"error": "lease_s and paused_ms must be finite numbers >= 0"})
                    return
                lease = leases.renew(
                    parts[2], lease_s, kind if isinstance(kind, str) else None, paused_s
                )
                if lease is None:
                    self._answer(parts[2], None)
                else:
                    now = leases.clock()
                    self._send(200, {"expires_in_s": round(lease.expires_at - now, 3)})
            else:
                self._send(404, {"error": "not found"})

        def do_DELETE(self) -> None:
            parts, query = self._route()
            if self._body() is None or not self._authorized():
                return
            if on_call is not None:
                on_call()
            if len(parts) == 3 and parts[:2] == ["kvturn", "leases"]:
                claimed = query.get("claimed", ["0"])[0] in ("1", "true")
                self._send(200, {"released": leases.release(parts[2], end_claim=claimed)})
            else:
                self._send(404, {"error": "not found"})

        # ---- helpers ----

        def _route(self) -> tuple[list[str], dict[str, list[str]]]:
            url = urlsplit(self.path)
            return [unquote(p) for p in url.path.strip("/").split("/")], parse_qs(url.query)

        def _wait_s(self, query: dict[str, list[str]]) -> float | None:
            try:
                wait_s = min(float(query.get("wait_ms", ["0"])[0]) / 1000, _MAX_WAIT_S)
            except ValueError:
                self._send(400, {"error": "wait_ms must be a number"})
                return None
            return max(wait_s, 0.0)

        def _authorized(self) -> bool:
            if secret is None:
                return True
            given = self.headers.get("Authorization", "")
            if given.startswith("Bearer ") and hmac.compare_digest(
                given[len("Bearer ") :].encode(), secret
            ):
                return True
            self._send(401, {"error": "the kvturn control channel needs the shared secret"})
            return False

        def _body(self) -> dict[str, Any] | None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > _MAX_BODY:
                self._send(400, {"error": "bad Content-Length"})
                return None
            raw = self.rfile.read(length) if length else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self._send(400, {"error": "the body must be a JSON object"})
                return None
            return body

        def _answer(self, key: str, lease: Lease | None) -> None:
            if lease is None:
                self._send(404, {"error": "no live lease", "reason": leases.gone_reason(key)})
            else:
                self._send(200, lease_answer(lease, leases.clock()))

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("control: " + format, *args)

    return Handler
