"""Run the gateway (:mod:`.http_server`) in the foreground or on a background thread."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import uvloop

from kvturn.gateway.app import GatewayApp, create_app
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.http_server import HttpServer

logger = logging.getLogger("kvturn.gateway")


def serve(config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve in the foreground until SIGINT/SIGTERM; in-flight requests get to finish."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )

    async def main() -> None:
        server = HttpServer(create_app(config), host, port)
        try:
            await server.start()
        except OSError as error:
            raise SystemExit(f"kvturn serve: cannot listen on {host}:{port}: {error}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        logger.info("kvturn gateway listening on http://%s:%d", host, server.port)
        await stop.wait()
        logger.info("kvturn gateway stopping")
        await server.stop()

    uvloop.run(main())


class GatewayThread:
    """The gateway on a background thread of this process (``kvturn up``, tests)."""

    def __init__(self, config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000):
        self.app: GatewayApp = create_app(config)
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        #: The HTTP server, once the thread runs.
        self.server: HttpServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvturn-gateway", daemon=True)

    def _run(self) -> None:
        uvloop.run(self._main())

    async def _main(self) -> None:
        server = self.server = HttpServer(self.app, self.host, self.port)
        try:
            await server.start()
        except BaseException as error:
            self._error = error
            self._ready.set()
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.stop(grace_s=5.0)

    def start(self, timeout_s: float = 30.0) -> GatewayThread:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"gateway did not start on {self.url}")
        if self._error is not None:
            raise RuntimeError(
                f"gateway did not start on {self.url}: {self._error}"
            ) from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
