"""The one Redis client a gateway's state shares (``--state redis://…``).

The conversation table (:mod:`.table_redis`), the implicit index (:mod:`.implicit`) and the
response store (:mod:`.response_store`) reach Redis through one :class:`RedisState`: one
``redis.asyncio.Redis`` client (one connection pool; their scripts are registered on it), one
timeout on every call (the gateway's ``state_timeout_s``), one key prefix, and one account of
outages (logged once as one starts and once as it ends; every failed call counted by
``on_error``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvturn.gateway.errors import StateUnavailable

logger = logging.getLogger("kvturn.gateway.state")


def uses_redis(url: str | None) -> bool:
    """Whether a gateway's ``state`` setting names Redis (``redis://…``, ``rediss://…``,
    ``unix://…``) rather than this process (``None``, ``""``, ``memory``); anything else is
    an error that names it."""
    if url is None or url in ("", "memory"):
        return False
    if url.startswith(("redis://", "rediss://", "unix://")):
        return True
    raise ValueError(f"unknown state store {url!r}: use 'memory' or a redis:// URL")


class RedisState:
    """Redis at ``url`` (``redis://host:port/db``), for every store of a gateway's state.

    ``timeout_s`` bounds each call, connecting included: past it (or when Redis cannot be
    reached) the call fails with :class:`~kvturn.gateway.errors.StateUnavailable`, and a turn
    recomputes instead of waiting. ``prefix`` starts every key. ``on_error`` is called with
    the operation's name when a call fails (a metric)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        prefix: str = "kvturn:",
        on_error: Callable[[str], None] | None = None,
    ):
        # Imported here: only a gateway configured with Redis state needs the client.
        import redis.asyncio

        #: The client (``redis.asyncio.Redis``); its pool serves every store.
        self.client: Any = redis.asyncio.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        #: What a failed Redis call raises.
        self.errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self.prefix = prefix
        self.on_error = on_error or (lambda op: None)
        self._down_since: float | None = None

    def failed(self, op: str, error: BaseException) -> StateUnavailable:
        """Count a failed call; log the outage once, as it starts. Returns what to raise."""
        self.on_error(op)
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "state store unreachable (%s: %s): turns recompute and keep no KV until it "
                "is back (kvturn_state_errors_total counts the failed calls)",
                op,
                error,
            )
        return StateUnavailable("the gateway's state store is unavailable")

    def succeeded(self) -> None:
        """A call answered: if an outage was under way, it is over (logged)."""
        if self._down_since is not None:
            logger.warning(
                "state store reachable again after %.1f s: reuse resumes",
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    @property
    def reachable(self) -> bool:
        """Whether the last call that counted (:meth:`failed`, :meth:`succeeded`) answered."""
        return self._down_since is None

    async def close(self) -> None:
        await self.client.aclose()
