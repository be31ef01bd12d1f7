"""Run the gateway app under uvicorn (uvloop + httptools), in the foreground or a thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from kvturn.gateway.app import create_app
from kvturn.gateway.config import GatewayConfig


def uvicorn_config(
    config: GatewayConfig, host: str, port: int, log_level: str = "warning"
) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(config),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=log_level,
        # The gateway's own URLs never depend on the client's address; skipping uvicorn's
        # proxy-headers middleware saves a call layer per request. No "server" header either.
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=60,
    )


def serve(config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve in the foreground until SIGINT/SIGTERM."""
    uvicorn.Server(uvicorn_config(config, host, port, log_level="info")).run()


class GatewayThread:
    """The gateway on a background thread of this process (``kvturn up``, tests)."""

    def __init__(self, config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000):
        self.server = uvicorn.Server(uvicorn_config(config, host, port))
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="kvturn-gateway", daemon=True)

    def start(self, timeout_s: float = 30.0) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start on {self.url}")
            time.sleep(0.05)
        return self

    @property
    def app(self):  # type: ignore[no-untyped-def]
        return self.server.config.app

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
