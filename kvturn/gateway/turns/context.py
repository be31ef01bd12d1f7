"""What every collaborator of a turn shares: the configuration, the two pools, the engine
client, the conversation table, the metrics, the lease client, the learned costs, the limits of
decode-local turns and the learned lease lengths; and the background work a turn leaves
(freeing leases, recording replies), which the gateway lets finish when it stops."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.congestion import BulkLane, LoopLag
from kvturn.gateway.http.upstream import Upstream
from kvturn.gateway.leases import LeaseClient
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.planner import CostModel, LocalLimits
from kvturn.gateway.pools import Instance, Pool
from kvturn.gateway.returns import ReturnLeases
from kvturn.gateway.state.table import ConversationTable
from kvturn.gateway.turns.model import Turn


@dataclass(slots=True, eq=False)
class TurnContext:
    config: GatewayConfig
    prefill: Pool
    decode: Pool
    upstream: Upstream
    store: ConversationTable
    metrics: GatewayMetrics
    leases: LeaseClient
    costs: CostModel
    limits: LocalLimits
    #: Lease lengths for clients that send no heartbeats, learned per tenant.
    returns: ReturnLeases
    #: Plan a turn that extends the held one from a bound on its new tokens (see
    #: :mod:`kvturn.gateway.extension`); off for good once a bound did not hold.
    bound_extensions: bool = True
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    #: How late the event loop runs (watched by the gateway), and the batch prompts that
    #: yield to it.
    lag: LoopLag = field(default_factory=LoopLag)
    lane: BulkLane = field(default_factory=BulkLane)

    @classmethod
    def create(
        cls,
        config: GatewayConfig,
        prefill: Pool,
        decode: Pool,
        upstream: Upstream,
        store: ConversationTable,
        metrics: GatewayMetrics,
    ) -> TurnContext:
        limits = LocalLimits(
            enabled=config.decode_local,
            max_suffix_tokens=config.max_local_suffix_tokens,
            max_running=config.max_local_running,
            stall_weight=config.local_stall_weight,
            preference=config.local_preference,
            stall_budget_s=config.local_stall_budget_s,
        )
        leases = LeaseClient(upstream, config.control_secret)
        returns = ReturnLeases(config.lease_s, enabled=config.learned_lease)
        return cls(
            config, prefill, decode, upstream, store, metrics, leases, CostModel(), limits, returns
        )

    def lease_for(self, turn: Turn) -> float:
        """The lease to ask for the KV ``turn`` leaves: the heartbeat lease where its client
        beats through the pause after it, else as long as its tenant's conversations take to
        come back (:mod:`kvturn.gateway.returns`)."""
        if turn.heartbeats:
            return self.config.lease_for(heartbeats=True)
        return self.returns.lease_for(turn.tenant)

    def background_task(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` off the response path (awaited for a while when the gateway stops)."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def release_later(self, holder: Instance, key: str, *, claimed: bool = False) -> None:
        """Free a lease nobody will read, off the response path."""
        if holder.control_url is None:
            return
        self.background_task(self.leases.release(holder.control_url, key, claimed=claimed))

    def release_url_later(self, holder_url: str, request_id: str) -> None:
        holder = self.decode.get(holder_url)
        if holder is not None:
            self.release_later(holder, request_id)

    async def close(self, grace_s: float) -> None:
        """Let background work (recording where replies left their KV, freeing leases) finish
        for up to ``grace_s``: with a shared table, the next turn may come to another replica
        or to this gateway's successor. Then cancel what is left."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=grace_s)
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
