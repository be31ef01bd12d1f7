"""Run the gateway (its app on :mod:`kvturn.gateway.http.server`, within the limits its
configuration sets) in the foreground, on a background thread, or as several worker processes
on one port.

Workers (``kvturn serve --workers N``): N processes, each a whole gateway listening on the
same port with ``SO_REUSEPORT`` (the kernel spreads connections across them), started and
watched by one supervisor that restarts a worker that dies and stops them all on SIGINT or
SIGTERM. Any turn is answered correctly by whichever worker gets it; with ``--state
redis://…`` every worker also finds every conversation's KV (in process, each has its own
table, and a turn reuses only where the same worker served the previous one). ``/metrics``
from any worker counts every worker's turns (:mod:`.metrics`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import IO, Any

import uvloop
from starlette.applications import Starlette

from kvturn.gateway.api.authenticate import head_admission
from kvturn.gateway.app import create_app, create_metrics_app
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.http.server import HttpServer, ServerLimits
from kvturn.gateway.metrics import MULTIPROC_DIR_ENV
from kvturn.gateway.state.redis_client import uses_redis

logger = logging.getLogger("kvturn.gateway")

#: Container allocations (net) between two young garbage collections; Python's default is 700.
#: At that default, garbage collection took 7% of the gateway's CPU at concurrency 32 (py-spy
#: with native frames, ``gc_collect_main``): a young collection walks every young object still
#: alive, and with many turns in flight there are many. Measured (gateway_overhead's fake
#: engine, concurrency 32, 3 rounds of 15,000 requests without an id, gateway CPU per request):
#: 187 µs (239 µs streamed) at 700; 178 µs (215 µs) at 7,000; 20,000 and 50,000 no better.
#: Cyclic garbage waits a little longer: at most this many objects.
GC_YOUNG_THRESHOLD = 7000


def server_limits(config: GatewayConfig) -> ServerLimits:
    """The HTTP server's limits the gateway's configuration sets (the rest: the server's)."""
    return ServerLimits(
        max_body_bytes=config.max_body_bytes,
        body_budget_bytes=config.body_budget_bytes,
        caller_body_budget_bytes=config.caller_body_budget_bytes,
        read_timeout_s=config.read_timeout_s,
        max_connections=config.max_connections,
        admit=head_admission(
            config.api_keys,
            config.operator_keys,
            config.guard_metrics and not config.metrics_port,  # else served elsewhere
        ),
    )


def metrics_server(app: Starlette, host: str, *, reuse_port: bool = False) -> HttpServer | None:
    """The listener of ``app``'s ``/metrics`` on an address of its own (``metrics_port``), if
    the gateway has one: a scrape is a small GET, and its limits are a scrape's."""
    config: GatewayConfig = app.state.gateway.config
    if not config.metrics_port:
        return None
    limits = ServerLimits(
        max_body_bytes=64 * 1024,
        body_budget_bytes=1024 * 1024,
        caller_body_budget_bytes=1024 * 1024,
        read_timeout_s=10.0,
        max_connections=64,
        admit=head_admission(config.api_keys, config.operator_keys, config.guard_metrics),
    )
    return HttpServer(
        create_metrics_app(app),
        config.metrics_host or host,
        config.metrics_port,
        limits=limits,
        reuse_port=reuse_port,
    )


_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """The gateway's logs on stderr: kvturn's loggers (``kvturn.gateway``, the access log's
    ``kvturn.access``) at ``level``, other libraries' at WARNING (or ``level``, if higher);
    ``log_format`` ``text`` or ``json`` (one object a line, by python-json-logger: ``time``,
    ``level``, ``logger``, ``message``, and the access log's fields). A process whose root
    logger already has a handler (an embedding application) keeps it, and only the levels
    are set."""
    threshold: int = getattr(logging, level.upper())
    logging.getLogger("kvturn").setLevel(threshold)
    root = logging.getLogger()
    root.setLevel(max(threshold, logging.WARNING))
    if not root.handlers:
        root.addHandler(log_handler(log_format))


def log_handler(log_format: str, stream: IO[str] | None = None) -> logging.Handler:
    """A handler writing to ``stream`` (stderr) in ``log_format``: ``text`` or ``json``."""
    handler = logging.StreamHandler(stream)
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    return handler


def serve(
    config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, workers: int = 1
) -> None:
    """Serve in the foreground until SIGINT/SIGTERM; in-flight requests get to finish."""
    configure_logging(config.log_level, config.log_format)
    if workers > 1:
        pool = GatewayWorkers(config, host, port, workers)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop.set())
        try:
            pool.start()
        except RuntimeError as error:
            raise SystemExit(f"kvturn serve: {error}") from None
        try:
            while not stop.wait(0.5):
                pool.watch()
        finally:
            pool.stop()
        return
    uvloop.run(_serve_until_signalled(config, host, port, reuse_port=False))


async def _serve_until_signalled(
    config: GatewayConfig, host: str, port: int, *, reuse_port: bool, ready: Any = None
) -> None:
    app = create_app(config)
    server = HttpServer(app, host, port, limits=server_limits(config), reuse_port=reuse_port)
    scrapes = metrics_server(app, host, reuse_port=reuse_port)
    for listener in (server, scrapes):
        if listener is None:
            continue
        try:
            await listener.start()
        except OSError as error:
            if ready is not None:
                ready.put(("error", os.getpid(), str(error)))
            if listener is scrapes:
                await server.stop(grace_s=0.0)
            where = f"{listener.host}:{listener.port}"
            raise SystemExit(f"kvturn serve: cannot listen on {where}: {error}") from None
    # What start-up made (modules, the app, pools) lives as long as the process: frozen, a
    # full collection no longer walks it while turns wait. Measured, one run each
    # (gateway_overhead's load, ~37k turns): full collections took 926 ms in all, up to 95 ms
    # each, and the concurrency-32 p99 was 62 ms; frozen, 255 ms in all, p99 17 ms.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("kvturn gateway listening on http://%s:%d (pid %d)", host, server.port, os.getpid())
    if scrapes is not None:
        logger.info("kvturn gateway /metrics on http://%s:%d", scrapes.host, scrapes.port)
    if ready is not None:
        ready.put(("ready", os.getpid(), ""))
    await stop.wait()
    logger.info("kvturn gateway stopping")
    if scrapes is not None:
        await scrapes.stop()
    await server.stop()


def _worker_main(config: GatewayConfig, host: str, port: int, ready: Any) -> None:
    """One worker process (started by :class:`GatewayWorkers`)."""
    configure_logging(config.log_level, config.log_format)
    uvloop.run(_serve_until_signalled(config, host, port, reuse_port=True, ready=ready))


class GatewayWorkers:
    """``workers`` gateway processes on one port (``SO_REUSEPORT``), supervised: a worker
    that dies is started again (at most once a second); :meth:`stop` ends them all, letting
    in-flight requests finish."""

    def __init__(self, config: GatewayConfig, host: str, port: int, workers: int):
        if port == 0:
            raise ValueError("workers share one port: give a port, not 0")
        if not uses_redis(config.state):
            logger.warning(
                "%d workers with in-process state: each worker has its own conversation table, "
                "so a turn reuses KV only when the worker that served the previous turn gets "
                "it; --state redis://… shares one table between them",
                workers,
            )
        self.config = config
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.workers = workers
        # Spawned, not forked: a worker starts from a clean interpreter, whatever threads
        # (a gateway thread, an engine launcher) the supervising process runs.
        self._context = multiprocessing.get_context("spawn")
        self._ready = self._context.Queue()
        self.processes: list[Any] = []
        self._last_restart = 0.0
        #: The metrics directory this supervisor made (none when the operator gave one).
        self._metrics_dir: str | None = None

    def _spawn(self) -> Any:
        process = self._context.Process(
            target=_worker_main,
            args=(self.config, self.host, self.port, self._ready),
            name="kvturn-gateway-worker",
            daemon=True,
        )
        process.start()
        return process

    def start(self, timeout_s: float = 60.0) -> GatewayWorkers:
        """Start every worker; return once each listens (raises if one cannot)."""
        if not os.environ.get(MULTIPROC_DIR_ENV):
            # The workers' metrics, in files any of them reads for /metrics. Set here, in the
            # supervisor's environment, before any worker starts: a worker's prometheus_client
            # picks its mode when it is imported (vLLM's API server does the same).
            self._metrics_dir = tempfile.mkdtemp(prefix="kvturn-metrics-")
            os.environ[MULTIPROC_DIR_ENV] = self._metrics_dir
        self.processes = [self._spawn() for _ in range(self.workers)]
        deadline = time.monotonic() + timeout_s
        for _ in range(self.workers):
            remaining = deadline - time.monotonic()
            try:
                state, pid, detail = self._ready.get(timeout=max(0.1, remaining))
            except Exception:
                self.stop()
                raise RuntimeError(f"gateway workers did not start on {self.url}") from None
            if state != "ready":
                self.stop()
                raise RuntimeError(f"a gateway worker (pid {pid}) cannot listen: {detail}")
        logger.info("kvturn gateway: %d workers on %s", self.workers, self.url)
        return self

    def watch(self) -> None:
        """Start again a worker that died (call it periodically)."""
        for i, process in enumerate(self.processes):
            if process.is_alive() or time.monotonic() - self._last_restart < 1.0:
                continue
            logger.warning(
                "gateway worker pid %s exited with %s; starting another",
                process.pid,
                process.exitcode,
            )
            self._last_restart = time.monotonic()
            self.processes[i] = self._spawn()

    def stop(self, grace_s: float = 15.0) -> None:
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        self.processes = []
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            if os.environ.get(MULTIPROC_DIR_ENV) == self._metrics_dir:
                del os.environ[MULTIPROC_DIR_ENV]
            self._metrics_dir = None


class GatewayThread:
    """The gateway on a background thread of this process (``kvturn up``, tests)."""

    def __init__(self, config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000):
        self.app: Starlette = create_app(config)
        self.limits = server_limits(config)
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        #: The HTTP server, once the thread runs; and ``/metrics``'s own, if it has one.
        self.server: HttpServer | None = None
        self.metrics_server = metrics_server(self.app, host)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvturn-gateway", daemon=True)

    def _run(self) -> None:
        uvloop.run(self._main())

    async def _main(self) -> None:
        server = self.server = HttpServer(self.app, self.host, self.port, limits=self.limits)
        started = False
        try:
            await server.start()
            started = True
            if self.metrics_server is not None:
                await self.metrics_server.start()
        except BaseException as error:
            self._error = error
            if started:
                await server.stop(grace_s=0.0)
            self._ready.set()
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            if self.metrics_server is not None:
                await self.metrics_server.stop(grace_s=1.0)
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
