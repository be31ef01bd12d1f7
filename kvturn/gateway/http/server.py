"""The gateway's HTTP/1.1 server: it listens, holds the connections (:mod:`.connection`) and
runs the app's lifespan. Every request, turns included, goes through the gateway's ASGI app
(:func:`~kvturn.gateway.app.create_app`), so the app's lifespan and middleware apply to all of
them; the turn endpoints are raw ASGI endpoints inside it (see :mod:`kvturn.gateway.replies`).
Its limits come in as :class:`ServerLimits`.

Why its own server and not uvicorn or granian: measured on 2026-12-02
(``benchmarks/gateway_overhead.py --servers``, one run, the same app served whole by
maintained servers): uvicorn with httptools added 0.08 ms more at concurrency 1 (0.10 ms
streamed) and served 13% fewer requests/s at concurrency 32 (15% streamed); granian 2.8.7
added 0.21 ms more (0.40 ms) at 11% (25%) fewer; uvicorn with h11 0.22 ms (0.43 ms) more at
39% (47%) fewer. uvicorn with httptools sits at the edge of "within 0.1 ms and 20%", inside
this machine's run-to-run noise (about ±0.2 ms that day; see
benchmarks/results/gateway_overhead.md). Turns then skipped the ASGI app on this server;
since they go through it, this server serves about 10% fewer turns/s at concurrency 32 than
it did (3,556 vs 3,925, 6 alternating rounds of one run; most of it Starlette's middleware
stack, 3,763 without it), and the speed difference is gone: rerun the same afternoon on a
machine then about twice as slow, this server added 0.97 ms at concurrency 1 and served 2,087
requests/s at 32, uvicorn with httptools 1.05 ms and 2,321 (streamed: 0.85 vs 0.99 ms, 2,004
vs 2,079). What decides is robustness.

It is kept because of what the same servers do under the attack cases this module answers
(``benchmarks/http_robustness.py``, 2026-12-02, each with its closest settings to this
server's read deadline and connection cap; benchmarks/results/http_robustness.md): uvicorn with
httptools left a trickled head and a trickled body open past 20 s, buffered a 64 MB header line
whole and answered it 200 (+128 MB peak memory, 5.4 s of CPU, ``/health`` at 1.9 s for
everyone meanwhile), closed new connections unanswered past 1,100 idle ones (no 503), and let
a chunked trailer become the conversation id; uvicorn with h11 and granian each left at least
the trickled body open, and no ASGI server cancels a non-streamed turn's engine request when its
client leaves (this server cancels a POST's handler then). Here every case is bounded: 408 at
the read deadline, 431 after 3.2 MB, a 503 past the cap, the engine request cancelled within
0.5 s, trailers ignored.

What it does as an HTTP server: keep-alive with an idle timeout, pipelined requests
answered in order, ``Expect: 100-continue``, HTTP/1.0 clients (no chunked replies, closed
after), limits on the request head (431) and body (413, also when chunked), malformed
requests answered 400 and closed, back-pressure on slow stream readers, a stream stopped (and
its engine request closed) as soon as its reader disconnects, and a graceful stop that lets
in-flight requests finish. Every error body is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource

from asgi_lifespan import LifespanManager

from kvturn.gateway.http.budget import BodyBudget
from kvturn.gateway.http.connection import Connection, ServerLimits
from kvturn.gateway.http.exchange import ASGIApp

logger = logging.getLogger("kvturn.gateway")

#: File descriptors kept for the gateway's own connections (engines, Redis, logs).
_FD_RESERVE = 256


def _connection_cap(configured: int) -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - _FD_RESERVE >= configured:
        return configured
    cap = max(16, soft - _FD_RESERVE)
    logger.warning(
        "max_connections %d lowered to %d: this process may open %d files (ulimit -n)",
        configured,
        cap,
        soft,
    )
    return cap


class HttpServer:
    """Serves an ASGI app (the gateway's: :func:`~kvturn.gateway.app.create_app`) on
    ``host:port``, its lifespan included, within ``limits`` (the defaults of
    :class:`ServerLimits` when none are given)."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        limits: ServerLimits | None = None,
        reuse_port: bool = False,
    ):
        self.app = app
        #: What serves requests once the lifespan started: the app with its lifespan state.
        self.serving: ASGIApp = app
        self._lifespan = contextlib.AsyncExitStack()
        #: Listen with ``SO_REUSEPORT``: several worker processes share the port.
        self.reuse_port = reuse_port
        self.host = host
        self.port = port
        self.limits = limits if limits is not None else ServerLimits()
        #: Open connections at once; past it, a new one gets a 503 and is closed. Never more
        #: than the process's file descriptors allow, less what the gateway needs for its own
        #: engine and state connections: past that, every new connection would fail.
        self.max_connections = _connection_cap(self.limits.max_connections)
        #: Request body bytes read and not yet served, on every connection, and by caller.
        self.budget = BodyBudget(
            self.limits.body_budget_bytes, self.limits.caller_body_budget_bytes
        )
        self.connections: set[Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start()

    @property
    def body_bytes_held(self) -> int:
        return self.budget.held

    async def start(self) -> None:
        """Run the app's lifespan start-up (the gateway's engine client, health checks),
        then listen."""
        self.loop = asyncio.get_running_loop()
        # No time limit: start-up waits for the engines' answers, each bounded on its own.
        lifespan = LifespanManager(self.app, startup_timeout=None, shutdown_timeout=None)
        self.serving = (await self._lifespan.enter_async_context(lifespan)).app
        try:
            self._server = await self.loop.create_server(
                lambda: Connection(self),
                self.host,
                self.port,
                backlog=2048,
                reuse_port=self.reuse_port or None,
            )
        except OSError:
            await self._lifespan.aclose()
            raise
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop listening, let in-flight requests finish (up to ``grace_s``), then stop."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = self.loop.time() + grace_s
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)
        await self._lifespan.aclose()


__all__ = ["HttpServer", "ServerLimits"]
