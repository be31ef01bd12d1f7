"""Scrapes (``/metrics``, ``/kvturn/status``) rendered afresh at most :data:`RENDERS_PER_S`
times a second per route, whoever asks.

A render costs the gateway's loop about 1.5 ms whatever the table's size (every metric
family; each decode connector's lease counts, asked over HTTP). Prometheus scrapes every few
seconds and ``kvturn top`` once a second, but nothing stops a caller from scraping in a loop
(``/metrics`` needs no key unless ``guard_metrics`` is on, as vLLM's): two such loops put
every other caller's steps behind renders (issue #39, case 3: another tenant's turns' p99 went
to 2.25x, ``benchmarks/results/isolation.md``). So each route keeps a token bucket of
renders (:data:`RENDERS_PER_S` a second, :data:`BURST` at once) and its last body: a scrape
renders afresh while the bucket holds a render, else gets the last body, at most
1/:data:`RENDERS_PER_S` s old. Scrapes that arrive while a render runs share it. A scraper
below the rate (every one a dashboard or a test runs) always gets a fresh body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

#: Fresh renders a route makes per second at most, once its burst is spent.
RENDERS_PER_S = 20
#: Fresh renders a route makes back to back before the rate holds.
BURST = 20


@dataclass(frozen=True, slots=True)
class Rendered:
    """A scrape's answer: status, body and content type."""

    status: int
    body: bytes
    media_type: str


class Scrape:
    """One route's renders: fresh while its bucket holds one, else the last."""

    def __init__(
        self,
        per_s: float = RENDERS_PER_S,
        burst: float = BURST,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.per_s = per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()
        self._last: Rendered | None = None
        self._rendering: asyncio.Future[Rendered] | None = None
        #: Renders made (fresh answers), for tests and the curious.
        self.renders = 0

    async def answer(self, render: Callable[[], Awaitable[Rendered]]) -> Rendered:
        if self._rendering is not None:
            return await asyncio.shield(self._rendering)
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._last is not None and self._tokens < 1:
            return self._last
        self._tokens -= 1
        self.renders += 1
        rendering = self._rendering = asyncio.ensure_future(render())
        try:
            self._last = await asyncio.shield(rendering)
        finally:
            self._rendering = None
        return self._last
