"""The gateway's Prometheus metrics, on a registry of its own (one per app instance).

Under ``kvturn serve --workers N`` every worker records into ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, set up by the supervisor before it starts them) and
``/metrics``, whichever worker answers it, shows every worker's turns together: counters and
histograms summed, gauges (set when scraped, from the shared table and the decodes) the most
recent.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

#: Set (by the workers' supervisor) for every worker process: metrics go to files there.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Fine enough between 1 and 10 s for CPU engines (GPU turns sit in the lower buckets).
_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    8.0, 10.0, 15.0, 30.0, 60.0,
)  # fmt: skip
_PAUSE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("kvturn_turns", "Turns served, by plan", ["plan"], registry=r)
        self.plans = Counter(
            "kvturn_turn_plans", "Turns served, by plan and the reason for it", ["plan", "reason"],
            registry=r,
        )  # fmt: skip
        self.kv_bytes_moved = Counter(
            "kvturn_kv_bytes_moved",
            "KV bytes the engines moved over NIXL for turns, by plan (decode-local moves none)",
            ["plan"], registry=r,
        )  # fmt: skip
        self.implicit = Counter(
            "kvturn_implicit_conversations",
            "Requests without a conversation id: matched to a recent turn, a fork of an older one "
            "(a new conversation sharing its KV), or a new conversation",
            ["result"], registry=r,
        )  # fmt: skip
        self.count_seconds = Histogram(
            "kvturn_prompt_count_seconds",
            "Asking the holder decode for a prompt's exact token ids (planning a reuse turn)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )  # fmt: skip
        self.uncounted_turns = Counter(
            "kvturn_uncounted_turns",
            "decode-local turns planned from a bound on their new tokens (the request extends "
            "the held one), their prompt counted after the reply",
            registry=r,
        )
        self.bound_violations = Counter(
            "kvturn_bound_violations",
            "Uncounted turns whose holder computed more than their bound said (the gateway "
            "then counts every turn's tokens while planning)",
            registry=r,
        )
        self.fallbacks = Counter(
            "kvturn_reuse_fallbacks",
            "Turns that could not reuse, by reason",
            ["reason"],
            registry=r,
        )
        self.state_errors = Counter(
            "kvturn_state_errors",
            "Operations on the shared state store (Redis) that failed, by operation",
            ["op"], registry=r,
        )  # fmt: skip
        self.reused_tokens = Counter(
            "kvturn_reused_tokens", "Prompt tokens whose KV was pulled, not recomputed", registry=r
        )
        self.recomputed_tokens = Counter(
            "kvturn_recomputed_tokens",
            "Prompt tokens the engines computed (prefill's, and a decode-local turn's suffix)",
            registry=r,
        )
        self.local_suffix_tokens = Counter(
            "kvturn_local_suffix_tokens",
            "Prompt tokens decode-local turns left their holder to compute: the suffix past what "
            "its prefix cache was to serve (as planned; a whole reply's, as the holder reported)",
            registry=r,
        )
        self.ttft = Histogram(
            "kvturn_ttft_seconds", "Time to the first streamed chunk, by plan", ["plan"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "kvturn_prefill_seconds", "Prefill round trip, by plan", ["plan"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.live_conversations = Gauge(
            "kvturn_live_conversations", "Conversations with a live lease", registry=r,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.turn_retries = Counter(
            "kvturn_turn_retries", "Requests that repeated the previous turn id (SDK retries)",
            registry=r,
        )  # fmt: skip
        self.heartbeats = Counter("kvturn_heartbeats", "Heartbeats received", registry=r)
        self.releases = Counter("kvturn_releases", "Conversations released", registry=r)
        self.conversations_forgotten = Counter(
            "kvturn_conversations_forgotten",
            "Idle conversations with no live KV dropped from the table", registry=r,
        )  # fmt: skip
        self.conversations = Gauge(
            "kvturn_conversations", "Conversations in the table (live KV or not)", registry=r,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.pauses = Histogram(
            "kvturn_client_pause_seconds", "Pauses before turns reported by clients", ["kind"],
            buckets=_PAUSE_BUCKETS, registry=r,
        )  # fmt: skip
        self.lease_renewals = Counter(
            "kvturn_lease_renewals", "Heartbeats passed to the holder decode, by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.decode_leases = Gauge(
            "kvturn_decode_leases", "Live leases on each decode (its connector's count)",
            ["decode"], registry=r, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.decode_lease_blocks = Gauge(
            "kvturn_decode_lease_blocks", "KV blocks each decode holds under leases",
            ["decode"], registry=r, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.decode_lease_events = Gauge(
            "kvturn_decode_lease_events",
            "Lease events on each decode since it started: retained, not_retained, renewed, "
            "claimed, and ended_<reason> (read, expired, released, reclaimed, superseded)",
            ["decode", "event"], registry=r, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.upstream_errors = Counter(
            "kvturn_upstream_errors", "Engine requests that failed, by role", ["role"], registry=r
        )
        self.drain_handoffs = Counter(
            "kvturn_drain_handoffs",
            "Next turns of conversations a draining decode held: pulled (from it), cached (in "
            "prefill's prefix cache already: nothing to pull), or lost (it had stopped, or its "
            "KV was gone: recomputed)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "kvturn_stream_migrations",
            "Streams whose decode broke off mid-reply: continued on another engine, failed to "
            "(no engine took it), or impossible (bound reached, or not migratable)",
            ["outcome"], registry=r,
        )  # fmt: skip

        # Children by label value, looked up once: ``labels()`` costs microseconds per call on
        # the turn path. Label values come from small fixed sets (plans, reasons, roles, kinds).
        self.turns_by = _ByLabel(self.turns)
        self.plans_by = _ByLabel(self.plans)
        self.kv_bytes_moved_by = _ByLabel(self.kv_bytes_moved)
        self.implicit_by = _ByLabel(self.implicit)
        self.fallbacks_by = _ByLabel(self.fallbacks)
        self.ttft_by = _ByLabel(self.ttft)
        self.prefill_seconds_by = _ByLabel(self.prefill_seconds)
        self.pauses_by = _ByLabel(self.pauses)
        self.upstream_errors_by = _ByLabel(self.upstream_errors)
        self.migrations_by = _ByLabel(self.migrations)
        self.drain_handoffs_by = _ByLabel(self.drain_handoffs)
        self.lease_renewals_by = _ByLabel(self.lease_renewals)

    def render(self) -> bytes:
        if os.environ.get(MULTIPROC_DIR_ENV):
            # Every worker's values, from the files they all write.
            everyone = CollectorRegistry()
            MultiProcessCollector(everyone)
            return generate_latest(everyone)
        return generate_latest(self.registry)


class _ByLabel(dict[str | tuple[str, ...], Any]):
    """``by[value]`` is ``metric.labels(value)`` (``by[(a, b)]``: ``labels(a, b)``), created on
    first use and kept."""

    def __init__(self, metric: Any):
        super().__init__()
        self.metric = metric

    def __missing__(self, value: str | tuple[str, ...]) -> Any:
        labels = value if isinstance(value, tuple) else (value,)
        child = self[value] = self.metric.labels(*labels)
        return child
