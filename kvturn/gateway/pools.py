"""Prefill and decode pools: healthy instances, chosen by load, with health checks."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvturn.gateway.config import EngineEndpoint
from kvturn.gateway.errors import NoHealthyEngine
from kvturn.gateway.http.upstream import Upstream

logger = logging.getLogger("kvturn.gateway")


@dataclass(eq=False)
class Instance:
    """One engine: where it is, whether it answers, how many requests it is serving."""

    url: str
    control_url: str | None = None
    healthy: bool = True
    #: Its control server says it is draining (about to stop): it takes no new turns, and the
    #: conversations it holds are pulled from it while it still answers.
    draining: bool = False
    in_flight: int = 0
    host: str = field(init=False)
    #: Learned from what a decode's connector publishes: its KV block size (tokens) and the
    #: bytes of one token's KV (0 until known).
    block_size: int = field(default=0, init=False)
    kv_bytes_per_token: int = field(default=0, init=False)
    #: The longest lease its connector grants (seconds; 0 until known): a lease asked for
    #: longer is cut to it.
    max_lease_s: float = field(default=0.0, init=False)
    #: Push mode, prefill engines: the NIXL identity its control server reports (engine id,
    #: side channel, parallel sizes), asked once and asked again after a failure.
    identity: dict[str, Any] | None = field(default=None, init=False)
    #: When (``time.monotonic()``) this gateway last sent it a turn's request or a wake: an
    #: engine sent one lately has not been idle long enough to need a wake (see
    #: ``TurnRunner._wake_decode``).
    last_sent: float = field(default=-math.inf, init=False)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or "127.0.0.1"

    def lease_s(self, asked_s: float) -> float:
        """The lease this decode grants when ``asked_s`` is asked for."""
        return min(asked_s, self.max_lease_s) if self.max_lease_s > 0 else asked_s


class Pool:
    """Instances of one role. Least-loaded choice; a preferred instance wins ties."""

    def __init__(self, role: str, endpoints: Sequence[EngineEndpoint]):
        self.role = role
        self.instances = [Instance(e.url, e.control_url) for e in endpoints]
        self._by_url = {i.url: i for i in self.instances}

    def get(self, url: str | None) -> Instance | None:
        return self._by_url.get(url) if url else None

    def healthy(self) -> list[Instance]:
        """The instances that take new turns: answering, and not draining."""
        return [i for i in self.instances if i.healthy and not i.draining]

    def choose(
        self, prefer: str | None = None, exclude: Instance | None = None, slack: int = 0
    ) -> Instance:
        """The least loaded healthy instance, or ``prefer`` while it serves at most ``slack``
        requests more than that one."""
        candidates = [
            i for i in self.instances if i.healthy and not i.draining and i is not exclude
        ]
        if not candidates:
            raise NoHealthyEngine(f"no healthy {self.role} engine")
        preferred = self._by_url.get(prefer) if prefer else None
        best = min(candidates, key=lambda i: i.in_flight)
        if preferred in candidates and preferred.in_flight <= best.in_flight + slack:
            return preferred
        return best

    def affine(self, key: bytes) -> str | None:
        """The instance ``key`` belongs to by rendezvous hashing over every instance, healthy
        or not (so a key's instance changes only when that one leaves the pool's list, and
        keys spread evenly): where a conversation's earlier prompts went, and so where a
        prefix cache may still hold them. ``None`` for an empty pool."""
        if not self.instances:
            return None
        return max(
            self.instances,
            key=lambda i: hashlib.blake2b(i.url.encode() + b"\0" + key, digest_size=8).digest(),
        ).url


async def check_health_forever(
    pools: Sequence[Pool], upstream: Upstream, interval_s: float
) -> None:
    """Poll every instance's ``/health``; drop the silent ones, re-admit those that answer;
    and ask those with a control server whether they are draining."""
    while True:
        instances = [i for pool in pools for i in pool.instances]
        results = await asyncio.gather(
            *(upstream.is_healthy(i.url) for i in instances), return_exceptions=True
        )
        controlled = [i for i in instances if i.control_url is not None]
        drains = await asyncio.gather(
            *(upstream.is_draining(i.control_url) for i in controlled if i.control_url),
            return_exceptions=True,
        )
        for instance, draining in zip(controlled, drains, strict=True):
            if isinstance(draining, bool) and draining != instance.draining:
                logger.warning(
                    "engine %s is %s", instance.url, "draining" if draining else "taking turns"
                )
                instance.draining = draining
        for instance, ok in zip(instances, results, strict=True):
            if ok is None:
                continue  # not known (see Upstream.is_healthy): as it was
            alive = ok is True
            if alive != instance.healthy:
                logger.warning(
                    "%s %s is %s", "engine", instance.url, "back" if alive else "unhealthy"
                )
            instance.healthy = alive
        await asyncio.sleep(interval_s)
