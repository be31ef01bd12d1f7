"""A tiny HTTP server inside the decode engine process that answers the gateway.

It runs on a daemon thread of the engine-core process (where the scheduler-side connector
lives), on loopback by default. Routes:

``GET /kvturn/retained/{request_id}?wait_ms=N``
    The retained-KV params published for that request (404 if none).
``GET /kvturn/health``
    ``{"ok": true, "retained": <count>}``.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from kvturn.connector.retained_store import RetainedStore

logger = logging.getLogger(__name__)

_MAX_WAIT_S = 5.0


class ControlServer:
    """Serve a :class:`RetainedStore` over HTTP on ``host:port`` from a daemon thread."""

    def __init__(self, store: RetainedStore, host: str, port: int):
        self.store = store
        handler = _make_handler(store)
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


def _make_handler(store: RetainedStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts == ["kvturn", "health"]:
                self._send(200, {"ok": True, "retained": len(store)})
            elif len(parts) == 3 and parts[:2] == ["kvturn", "retained"]:
                query = parse_qs(url.query)
                try:
                    wait_s = min(float(query.get("wait_ms", ["0"])[0]) / 1000, _MAX_WAIT_S)
                except ValueError:
                    self._send(400, {"error": "wait_ms must be a number"})
                    return
                params = store.get(parts[2], wait_s=max(wait_s, 0.0))
                if params is None:
                    self._send(404, {"error": "no retained KV for that request"})
                else:
                    self._send(200, params)
            else:
                self._send(404, {"error": "not found"})

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
