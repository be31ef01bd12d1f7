"""Gateway settings: flags and ``KVTURN_*`` environment variables map onto one dataclass."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvturn.gateway.auth import ApiKeys, OperatorKeys
from kvturn.gateway.validation import MAX_BATCH_PROMPTS
from kvturn.wire import CONTROL_SECRET_ENV

#: A file of API keys (``key tenant`` per line); ``KVTURN_API_KEYS`` holds more inline.
API_KEYS_FILE_ENV = "KVTURN_API_KEYS_FILE"
#: The engines' API key: vLLM's own variable, so ``kvturn up``'s engines and gateway share it.
ENGINE_API_KEY_ENV = "VLLM_API_KEY"
#: A file of operator keys (one a line); ``KVTURN_OPERATOR_KEYS`` holds more inline.
OPERATOR_KEYS_FILE_ENV = "KVTURN_OPERATOR_KEYS_FILE"
#: The gateway's log levels and formats (``--log-level``, ``--log-format``).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class EngineEndpoint:
    """One vLLM engine the gateway routes to."""

    url: str
    #: The kvturn connector's control server (decode engines; prefill engines in push mode).
    control_url: str | None = None


@dataclass(frozen=True)
class GatewayConfig:
    prefill: tuple[EngineEndpoint, ...] = ()
    decode: tuple[EngineEndpoint, ...] = ()
    #: A conversation's lease: how long its KV stays reusable after a turn or heartbeat
    #: (never longer than the holder decode retains it).
    lease_s: float = 60.0
    #: The lease of a conversation whose client says it sends heartbeats (``X-Kvturn-Heartbeats``)
    #: and every heartbeat's renewal: its client beats at about half this through a pause of
    #: any length, and a client that stops (crashed, gone) frees the KV this long after its
    #: last beat instead of ``lease_s``. At most ``lease_s``.
    heartbeat_lease_s: float = 5.0
    #: A client that sends no heartbeats is leased for as long as its tenant's conversations
    #: take to come back (learned from the gaps between their turns, at most ``lease_s``:
    #: :mod:`kvturn.gateway.returns`); off: always ``lease_s``.
    learned_lease: bool = True
    #: Do not try to claim a lease this close to its end (by the gateway's last word from the
    #: holder): the claim would likely find it gone. A successful claim holds the lease on the
    #: holder until prefill's read ends, so this only saves a round trip.
    expiry_margin_s: float = 0.5
    #: Reuse only when at least this many tokens are held (below, recompute is as fast).
    reuse_threshold_tokens: int = 64
    #: Turns whose suffix is short go straight to the decode that holds the history
    #: (``decode-local``), within the bounds below; off: reuse always pulls into prefill.
    decode_local: bool = True
    #: Longest new suffix (tokens) a holder decode may prefill itself.
    max_local_suffix_tokens: int = 2048
    #: Requests a holder may already be serving for a local prefill to be considered.
    max_local_running: int = 8
    #: Weight of the delay a local prefill inflicts on the holder's other streams (see
    #: :class:`kvturn.gateway.planner.LocalLimits`).
    local_stall_weight: float = 1.0
    #: How much slower than a pull a decode-local turn may be predicted and still be chosen
    #: (see :class:`kvturn.gateway.planner.LocalLimits`).
    local_preference: float = 0.25
    #: The longest a local prefill may stall the holder's other streams, seconds (see
    #: :class:`kvturn.gateway.planner.LocalLimits`): past it, a busy holder's turn is pulled.
    #: Off (infinite) by default, as measured there.
    local_stall_budget_s: float = math.inf
    #: vLLM scheduling priority of a pull-reuse turn's prefill request (lower runs sooner;
    #: 0: none). Such a request computes only the turn's new suffix: on an engine started
    #: with ``--scheduling-policy priority`` (as kvturn's launchers start prefill engines) it
    #: runs before the whole-history recomputes waiting there, instead of behind them. An
    #: engine on vLLM's default first-come policy ignores it.
    pull_priority: int = -1
    #: Requests without a conversation id that extend a recent turn's messages and reply are
    #: served as that conversation's next turn.
    implicit_conversations: bool = True
    #: A request that starts from another live turn's context (a fork or subagent of a
    #: conversation, a parallel call, with an id or without) is served on the decode holding
    #: that context, which its prefix cache shares: every chat turn is indexed by its messages.
    shared_prefixes: bool = True
    #: Conversations remembered at once; the least recently used beyond this are dropped.
    max_conversations: int = 100_000
    #: Responses API responses kept for ``previous_response_id`` and ``GET`` (least recently
    #: used dropped first), and for how long each.
    max_responses: int = 10_000
    responses_ttl_s: float = 3600.0
    #: Where stored state lives: ``None``/``memory`` (this process) or ``redis://host:port/db``
    #: (shared by every gateway process and replica, kept across restarts).
    state: str | None = None
    #: Longest wait for the state store on one operation (the conversation table, the implicit
    #: index and the response store alike: they share one client): past it (or when Redis
    #: cannot be reached) a turn recomputes instead of waiting on it.
    state_timeout_s: float = 0.5
    max_body_bytes: int = 32 * 1024 * 1024
    #: Request body bytes held at once (being read or served), all connections together;
    #: past it, new bodies get a 503 (parsing one costs several times its size in memory).
    body_budget_bytes: int = 64 * 1024 * 1024
    #: Of which one tenant (one API key's, or the callers' without a key) may hold at once
    #: (429 past it): no tenant can take the whole budget from the others.
    caller_body_budget_bytes: int = 32 * 1024 * 1024
    #: Requests one tenant may have in flight at once on the turn routes (chat completions,
    #: completions, responses; a streamed one until its stream ends); past it, a 429 with
    #: ``Retry-After``. Twice the most any benchmark here runs at once (gateway_overhead: 256).
    #: 0: no limit. Counted per gateway process (:mod:`.callers`).
    caller_requests_in_flight: int = 512
    #: Engine requests one tenant's requests may hold at once: one a turn, up to
    #: ``BATCH_WINDOW`` a batch of prompts (fewer where fewer are left); a request that finds
    #: none left gets a 429 with ``Retry-After``. 0: no limit. Counted per gateway process.
    caller_engine_requests_in_flight: int = 512
    #: Prompts one completion request may carry (a batch: an engine request each, through
    #: a window), 1 to ``validation.MAX_BATCH_PROMPTS`` (256, the most the gateway serves);
    #: past it, a 400 naming ``prompt``.
    caller_batch_prompts: int = MAX_BATCH_PROMPTS
    #: A request (head and body) must arrive whole this soon after its first byte, or it
    #: gets a 408 and its connection is closed (a client trickling it holds nothing long).
    read_timeout_s: float = 60.0
    #: Client connections open at once; past it a new connection gets a 503 and is closed.
    max_connections: int = 4096
    #: Seconds to open an engine connection, and the longest an engine's host may acknowledge
    #: nothing on an open one before its request fails (an unplugged host: the turn falls back).
    connect_timeout_s: float = 5.0
    #: Upper bound on one engine request's wait: a whole reply, or a stream's first bytes and
    #: then each silence between its chunks (a stream that keeps sending is never cut).
    request_timeout_s: float = 600.0
    #: The longest a whole streamed reply may last, seconds (0: no cap).
    max_stream_s: float = 0.0
    #: How many times one streamed reply may move to another engine when its decode's stream
    #: breaks off or hangs mid-reply (:mod:`kvturn.gateway.turns.migrate`); 0: never (an error
    #: event).
    migration_limit: int = 2
    #: Seconds between health checks of every engine; also how long a migratable stream whose
    #: engine they marked unhealthy may send nothing before it moves (a hung engine).
    health_interval_s: float = 2.0
    #: How long to wait, after a decode reply ends, for its connector to publish the retained KV.
    publish_wait_s: float = 0.5
    #: Decode engines given without a control URL have their kvturn control server at this
    #: port of their own host (``kvturn engine``'s default is 8300); 0: such decodes have none
    #: (stock engines: no leases, no reuse from them).
    decode_control_port: int = 0
    #: How prefill's KV reaches decode: ``pull`` (decode READs it once prefill answered;
    #: reuse pulls the history back into prefill or continues on the holder decode) or
    #: ``push`` (decode registers its blocks while prefill computes and prefill WRITEs into
    #: them; reuse continues on the holder decode). The engines must run the matching
    #: connector (``kvturn up --transfer``); push needs each prefill's control URL.
    transfer: str = "pull"
    #: Push mode: once prefill has answered (and so writes the KV), how long decode may await
    #: that KV before the turn is taken to be lost (a failed write, a prefill that died) and
    #: served by a decode alone.
    push_write_timeout_s: float = 10.0
    #: The OpenTelemetry tracer provider to trace turns with (an application embedding the
    #: gateway, a test); None: the process's, or OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    #: (see :mod:`.tracing`).
    tracer_provider: Any = field(default=None, repr=False, compare=False)
    #: The secret decode engines' kvturn control servers require (``KVTURN_CONTROL_SECRET``).
    control_secret: str | None = field(default=None, repr=False)
    #: The API keys callers must present, each naming a tenant (none: the gateway is open).
    api_keys: ApiKeys = field(default_factory=ApiKeys, repr=False)
    #: The engines' own API key (vLLM's ``--api-key``), sent on every engine request; from
    #: ``VLLM_API_KEY``, the variable the engines themselves read.
    engine_api_key: str | None = field(default=None, repr=False)
    #: The keys of the operators' routes (``/kvturn/status``, and ``/metrics`` when guarded);
    #: none: those routes take any caller's key.
    operator_keys: OperatorKeys = field(default_factory=OperatorKeys, repr=False)
    #: ``/metrics`` needs an operator's key; off, it is open, as vLLM's own is with
    #: ``--api-key`` (a Prometheus scrape needs no key).
    guard_metrics: bool = False
    #: Serve ``/metrics`` on a listen address of its own (this port; ``metrics_host``, or the
    #: gateway's host when empty) and not on the gateway's port, as vLLM's engines and routers
    #: can: the scrape is reachable from the operators' network only. 0: on the gateway's port.
    metrics_port: int = 0
    metrics_host: str = ""
    #: One line per request on the ``kvturn.access`` logger (at INFO).
    access_log: bool = True
    #: The gateway's log level (one of ``LOG_LEVELS``) and format (``text`` or ``json``: one
    #: JSON object a line, the access log's fields as keys).
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        for endpoint in (*self.prefill, *self.decode):
            for url in (endpoint.url, endpoint.control_url):
                if url is not None:
                    check_engine_url(url)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be text or json, not {self.log_format!r}")
        if self.max_local_suffix_tokens < 0 or self.max_local_running < 0:
            raise ValueError("max_local_suffix_tokens and max_local_running must be >= 0")
        if not self.local_preference >= 0:
            raise ValueError(f"local_preference must be >= 0, not {self.local_preference}")
        if not self.local_stall_budget_s >= 0:
            raise ValueError(f"local_stall_budget_s must be >= 0, not {self.local_stall_budget_s}")
        if not self.local_stall_weight >= 0:
            raise ValueError(f"local_stall_weight must be >= 0, not {self.local_stall_weight}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, not {self.migration_limit}")
        if self.transfer not in ("pull", "push"):
            raise ValueError(f"transfer must be pull or push, not {self.transfer!r}")
        if self.transfer == "push" and any(p.control_url is None for p in self.prefill):
            raise ValueError(
                "push transfer needs each prefill engine's kvturn control URL (its NIXL "
                "identity): --prefill-control or KVTURN_PREFILL_CONTROL_URLS"
            )
        if self.caller_requests_in_flight < 0 or self.caller_engine_requests_in_flight < 0:
            raise ValueError(
                "caller_requests_in_flight and caller_engine_requests_in_flight must be >= 0 "
                "(0: no limit)"
            )
        if not 1 <= self.caller_batch_prompts <= MAX_BATCH_PROMPTS:
            raise ValueError(
                f"caller_batch_prompts must be 1 to {MAX_BATCH_PROMPTS}, not "
                f"{self.caller_batch_prompts}"
            )
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {self.lease_s}")
        if not self.heartbeat_lease_s > 0 or not math.isfinite(self.heartbeat_lease_s):
            raise ValueError(f"heartbeat_lease_s must be positive, not {self.heartbeat_lease_s}")
        if self.expiry_margin_s >= min(self.lease_s, self.heartbeat_lease_s):
            # Every lease would look lapsed as soon as it was granted: no turn would reuse.
            raise ValueError(
                f"expiry_margin_s ({self.expiry_margin_s}) must be less than lease_s "
                f"({self.lease_s}) and heartbeat_lease_s ({self.heartbeat_lease_s}), or no "
                "turn would ever reuse KV"
            )

    def lease_for(self, heartbeats: bool) -> float:
        """The lease to ask for a turn (or a heartbeat's renewal): the short heartbeat lease
        where the client beats through its pauses, else the one that must span a pause."""
        return min(self.lease_s, self.heartbeat_lease_s) if heartbeats else self.lease_s

    @classmethod
    def from_env(
        cls,
        base: Mapping[str, object] | None = None,
        api_keys_file: str | None = None,
        operator_keys_file: str | None = None,
        **overrides: object,
    ) -> GatewayConfig:
        """Defaults, then ``base`` (a deployment file's settings), then ``KVTURN_*``
        environment variables, then explicit ``overrides``. API keys come from the
        ``KVTURN_API_KEYS_FILE`` file, else ``api_keys_file``, plus ``KVTURN_API_KEYS``;
        operator keys likewise (``KVTURN_OPERATOR_KEYS_FILE``, ``operator_keys_file``,
        ``KVTURN_OPERATOR_KEYS``)."""
        env: dict[str, object] = dict(base or {})
        typed: dict[str, Callable[[str], object]] = {
            "lease_s": float, "heartbeat_lease_s": float, "learned_lease": parse_flag,
            "expiry_margin_s": float,
            "reuse_threshold_tokens": int,
            "max_conversations": int, "max_responses": int, "responses_ttl_s": float,
            "max_body_bytes": int, "body_budget_bytes": int, "caller_body_budget_bytes": int,
            "caller_requests_in_flight": int, "caller_engine_requests_in_flight": int,
            "caller_batch_prompts": int,
            "read_timeout_s": float,
            "max_connections": int,
            "connect_timeout_s": float,
            "request_timeout_s": float, "max_stream_s": float, "migration_limit": int,
            "health_interval_s": float, "publish_wait_s": float,
            "max_local_suffix_tokens": int, "max_local_running": int,
            "local_stall_weight": float, "local_preference": float, "decode_local": parse_flag,
            "local_stall_budget_s": float, "pull_priority": int,
            "implicit_conversations": parse_flag, "shared_prefixes": parse_flag, "state": str,
            "state_timeout_s": float,
            "decode_control_port": int, "transfer": str, "push_write_timeout_s": float,
            "guard_metrics": parse_flag, "metrics_port": int, "metrics_host": str,
            "access_log": parse_flag, "log_level": str.lower,
            "log_format": str.lower,
        }  # fmt: skip
        for name, kind in typed.items():
            value = os.environ.get(f"KVTURN_{name.upper()}")
            if value is not None:
                env[name] = kind(value)
        for role in ("prefill", "decode"):
            urls = os.environ.get(f"KVTURN_{role.upper()}_URLS")
            if urls:
                controls = os.environ.get(f"KVTURN_{role.upper()}_CONTROL_URLS", "")
                env[role] = endpoints(urls.split(","), [c for c in controls.split(",") if c])
        secret = os.environ.get(CONTROL_SECRET_ENV)
        if secret:
            env["control_secret"] = secret
        engine_key = os.environ.get(ENGINE_API_KEY_ENV)
        if engine_key:
            env["engine_api_key"] = engine_key
        keys = ApiKeys.load(os.environ.get(API_KEYS_FILE_ENV) or api_keys_file, os.environ)
        if not keys.open:
            env["api_keys"] = keys
        operators = OperatorKeys.load(
            os.environ.get(OPERATOR_KEYS_FILE_ENV) or operator_keys_file, os.environ
        )
        if operators.configured:
            env["operator_keys"] = operators
        env.update({k: v for k, v in overrides.items() if v is not None})
        port = int(env.get("decode_control_port") or 0)  # type: ignore[call-overload]
        if port:
            decodes: tuple[EngineEndpoint, ...] = env.get("decode", ())  # type: ignore[assignment]
            env["decode"] = with_control_port(decodes, port)
        return cls(**env)  # type: ignore[arg-type]


def parse_flag(value: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def check_engine_url(url: str) -> None:
    """Refuse, at start, an engine or control URL the gateway cannot reach: its engine client
    speaks plain HTTP/1.1 only (:mod:`kvturn.gateway.http.client`)."""
    if url.startswith("http://"):
        return
    if url.lower().startswith("https://"):
        raise ValueError(
            f"engine URL {url!r}: https:// is not supported; the gateway reaches engines and "
            "their control servers over plain http:// only (keep them on a private network, "
            "or terminate TLS in a sidecar next to the gateway and give its http:// URL)"
        )
    raise ValueError(f"engine URL {url!r} is not an http:// URL")


def with_control_port(decodes: tuple[EngineEndpoint, ...], port: int) -> tuple[EngineEndpoint, ...]:
    """Each decode given without a control URL gets ``http://<its host>:<port>``: the
    convention ``kvturn engine`` follows, so a deployment lists its engines once."""
    named = []
    for decode in decodes:
        if decode.control_url is None:
            host = urlsplit(decode.url).hostname or "127.0.0.1"
            host = f"[{host}]" if ":" in host else host
            decode = EngineEndpoint(decode.url, f"http://{host}:{port}")
        named.append(decode)
    return tuple(named)


def endpoints(urls: list[str], control_urls: list[str] | None = None) -> tuple[EngineEndpoint, ...]:
    """Pair engine URLs with control URLs given in the same order (missing ones are None)."""
    controls = list(control_urls or [])
    if len(controls) > len(urls):
        raise ValueError("more control URLs than engine URLs")
    controls += [None] * (len(urls) - len(controls))  # type: ignore[list-item]
    return tuple(
        EngineEndpoint(u.rstrip("/"), c.rstrip("/") if c else None)
        for u, c in zip(urls, controls, strict=True)
    )
