"""One gateway instance: what it owns (the pools, the engine client, the conversation table,
the response store, the metrics, the turn runner) and its background jobs (health checks, the
table's sweep, learning each decode's KV geometry), started and stopped by the app's lifespan
(:func:`~kvturn.gateway.app.create_app`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from kvturn.gateway import tracing
from kvturn.gateway.callers import CallerLimits
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.http.upstream import Upstream, UpstreamUnavailable
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.pools import Pool, check_health_forever
from kvturn.gateway.scrapes import Scrape
from kvturn.gateway.state.stores import open_state
from kvturn.gateway.turns.runner import TurnRunner
from kvturn.wire import BLOCK_SIZE_KEY, KV_BYTES_PER_TOKEN_KEY, MAX_LEASE_KEY

logger = logging.getLogger("kvturn.gateway")


class Gateway:
    """Everything one gateway instance owns: pools, table, metrics, upstream client."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        #: Spans for turns, if this gateway traces (:func:`~.tracing.tracer_for`).
        self.tracer = tracing.tracer_for(config.tracer_provider)
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.upstream = Upstream(
            config.connect_timeout_s,
            config.request_timeout_s,
            config.engine_api_key,
            max_stream_s=config.max_stream_s,
        )
        self.metrics = metrics = GatewayMetrics()
        #: What each tenant has in flight on the turn routes, and in engine requests.
        self.callers = CallerLimits(
            config.caller_requests_in_flight, config.caller_engine_requests_in_flight
        )

        def on_state_error(op: str) -> None:
            metrics.state_errors.labels(op).inc()

        #: The gateway's state: in this process, or shared in Redis (``config.state``).
        self.state = open_state(
            config.state,
            max_conversations=config.max_conversations,
            # An entry is kept while a turn may still run and a lease may still be renewed.
            idle_s=config.request_timeout_s + config.lease_s,
            max_responses=config.max_responses,
            responses_ttl_s=config.responses_ttl_s,
            timeout_s=config.state_timeout_s,
            on_error=on_state_error,
        )
        #: The conversation table.
        self.store = self.state.table
        self.runner = TurnRunner(
            config, self.prefill, self.decode, self.upstream, self.store, self.metrics
        )
        # Batches yield the loop only while turns are under way (:mod:`.congestion`).
        callers = self.callers
        self.runner.context.lane.contended = lambda: callers.turns_in_flight > 0
        #: Stored Responses API responses, for ``previous_response_id`` and ``GET``.
        self.responses = self.state.responses
        self.models: list[dict[str, Any]] = []
        #: ``/metrics`` and ``/kvturn/status``, each rendered afresh a bounded number of
        #: times a second (:mod:`.scrapes`).
        self.scrapes = {"metrics": Scrape(), "status": Scrape()}
        self._health: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._lag: asyncio.Task[None] | None = None
        self._learner: asyncio.Task[None] | None = None

    async def refresh_models(self) -> None:
        for instance in self.prefill.healthy():
            try:
                response = await self.upstream.get(f"{instance.url}/v1/models", timeout_s=5)
            except UpstreamUnavailable:
                continue
            if response.status == 200:
                self.models = list(response.json().get("data") or [])
                return

    async def start(self) -> None:
        """Open the engine client, learn the models, start health checks."""
        if self.config.api_keys.open:
            logger.warning(
                "no API keys configured: the gateway is open, every caller is one tenant "
                "(set KVTURN_API_KEYS or KVTURN_API_KEYS_FILE to require keys)"
            )
        await self.upstream.start()
        await self.refresh_models()
        self._health = asyncio.create_task(
            check_health_forever(
                [self.prefill, self.decode], self.upstream, self.config.health_interval_s
            )
        )
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._learner = asyncio.create_task(self._learn_decodes())
        # How late the loop runs: batches yield to the other callers' work while it is late.
        context = self.runner.context
        self._lag = asyncio.create_task(context.lag.watch(context.lane))

    async def _learn_decodes(self) -> None:
        """Each decode's block size and KV bytes per token, from its connector (for the
        planner's estimates and the KV-bytes-moved metric), asked every 2 s until every one
        answered."""
        async for attempt in AsyncRetrying(wait=wait_fixed(2.0), retry=retry_if_result(bool)):
            with attempt:
                unknown = await self._learn_decodes_once()
            if not attempt.retry_state.outcome.failed:  # type: ignore[union-attr]
                attempt.retry_state.set_result(unknown)

    async def _learn_decodes_once(self) -> list[str]:
        """Ask the decodes not known yet; those still unknown."""
        unknown = [i for i in self.decode.instances if i.control_url and not i.kv_bytes_per_token]
        for instance in unknown:
            assert instance.control_url is not None
            stats = await self.runner.context.leases.stats(instance.control_url)
            if stats:
                instance.block_size = int(stats.get(BLOCK_SIZE_KEY) or 0)
                instance.kv_bytes_per_token = int(stats.get(KV_BYTES_PER_TOKEN_KEY) or 0)
                instance.max_lease_s = float(stats.get(MAX_LEASE_KEY) or 0.0)
                if 0 < instance.max_lease_s < self.config.lease_s:
                    logger.warning(
                        "decode %s grants leases of at most %g s, less than the gateway's "
                        "lease (%g s): its conversations are told %g s (set --kv-ttl on the "
                        "engine, or lease_s here, to agree)",
                        instance.url,
                        instance.max_lease_s,
                        self.config.lease_s,
                        instance.max_lease_s,
                    )
        return [i.url for i in unknown if not i.kv_bytes_per_token]

    async def _sweep_forever(self) -> None:
        """Forget conversations that can no longer come back for their KV, a bounded batch a
        second: no turn pays for the table's size. An entry leaves once its lease lapsed and
        nothing touched it for longer than a turn may run plus a lease."""
        idle_s = self.config.request_timeout_s + self.config.lease_s
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            forgotten = self.store.sweep(idle_s, SWEEP_BUDGET)
            if forgotten:
                self.metrics.conversations_forgotten.inc(forgotten)

    async def stop(self) -> None:
        tasks = [
            t for t in (self._health, self._sweeper, self._learner, self._lag) if t is not None
        ]
        self._health = self._sweeper = self._learner = self._lag = None
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.runner.close()
        await self.upstream.close()
        await self.state.close()


#: How often idle conversations are swept from the table, and at most how many per sweep.
SWEEP_INTERVAL_S = 1.0
SWEEP_BUDGET = 2000
