"""``kvturn serve``: the gateway in front of running engines, its settings from defaults, a
deployment file (:mod:`.config_file`), ``KVTURN_*`` variables and flags, in that order."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable

from kvturn.gateway.config import LOG_FORMATS, LOG_LEVELS, GatewayConfig, endpoints, parse_flag
from kvturn.gateway.validation import MAX_BATCH_PROMPTS

#: Gateway settings that ``kvturn serve`` takes as flags (each also has a KVTURN_* variable).
_GATEWAY_TUNABLES: dict[str, tuple[Callable[[str], object], str]] = {
    "lease_s": (float, "conversation lease without turns or heartbeats, seconds"),
    "heartbeat_lease_s": (
        float,
        "lease of a conversation whose client sends heartbeats, and each heartbeat's renewal, "
        "seconds (at most lease_s)",
    ),
    "learned_lease": (
        parse_flag,
        "on/off: a client that sends no heartbeats is leased as long as its tenant's "
        "conversations take to come back (5 s to lease_s; default on)",
    ),
    "expiry_margin_s": (float, "never reuse KV this close to its expiry, seconds"),
    "reuse_threshold_tokens": (int, "reuse only when at least this many tokens are held"),
    "max_conversations": (int, "conversations remembered at once (LRU beyond)"),
    "max_body_bytes": (int, "largest request body accepted"),
    "body_budget_bytes": (int, "request body bytes held at once, all connections (503 past it)"),
    "caller_body_budget_bytes": (
        int,
        "of which one tenant (or the callers without a key) may hold at once (429 past it)",
    ),
    "caller_requests_in_flight": (
        int,
        "turn requests one tenant may have in flight at once (429 past it; 0: no limit)",
    ),
    "caller_engine_requests_in_flight": (
        int,
        "engine requests one tenant's turns and batches may hold at once (429 past it; "
        "0: no limit)",
    ),
    "caller_batch_prompts": (
        int,
        f"prompts one completion request may carry, 1 to {MAX_BATCH_PROMPTS} (400 past it)",
    ),
    "read_timeout_s": (float, "a request must arrive whole this soon, seconds (else 408)"),
    "max_connections": (int, "client connections open at once (503 past it)"),
    "connect_timeout_s": (
        float,
        "engine connect timeout, and how long an engine host may go silent, seconds",
    ),
    "request_timeout_s": (
        float,
        "longest wait on an engine: a whole reply, or a stream's first bytes and each silence "
        "in it, seconds",
    ),
    "max_stream_s": (float, "longest a whole streamed reply may last, seconds (0: no cap)"),
    "migration_limit": (
        int,
        "times a streamed reply may move to another engine when its decode breaks off (0: never)",
    ),
    "health_interval_s": (float, "engine health-check period, seconds"),
    "publish_wait_s": (float, "wait for decode to publish retained KV, seconds"),
    "decode_local": (parse_flag, "on/off: short turns continue on the decode holding the history"),
    "max_local_suffix_tokens": (int, "longest new suffix a holder decode prefills itself"),
    "max_local_running": (int, "requests a holder may be serving for a decode-local turn"),
    "local_stall_weight": (float, "weight of the delay a local prefill costs other streams"),
    "local_preference": (float, "a local prefill may be predicted this much slower than a pull"),
    "local_stall_budget_s": (
        float,
        "longest a local prefill may stall the holder's other streams, seconds (past it: pull; "
        "default inf, off)",
    ),
    "pull_priority": (
        int,
        "vLLM priority of a pull's prefill request, which computes only the new suffix "
        "(lower sooner; prefill engines need --scheduling-policy priority; 0: none)",
    ),
    "implicit_conversations": (parse_flag, "on/off: find conversations of requests without id"),
    "shared_prefixes": (
        parse_flag,
        "on/off: forks, subagents and parallel calls read the context they share on its decode",
    ),
    "max_responses": (int, "Responses API responses kept in process for chaining (LRU beyond)"),
    "responses_ttl_s": (float, "how long a stored Responses API response is kept, seconds"),
    "state": (str, "stored state: memory (this process) or redis://host:port/db (shared)"),
    "state_timeout_s": (float, "longest wait on the state store per operation, seconds"),
    "decode_control_port": (
        int,
        "control port of decodes given without a control URL: http://<decode host>:<port>",
    ),
    "transfer": (str, "pull (decode reads from prefill) or push (prefill writes to decode)"),
    "push_write_timeout_s": (float, "push: seconds decode may await pushed KV (then alone)"),
    "guard_metrics": (parse_flag, "on/off: /metrics needs an operator key (default off, as vLLM)"),
    "metrics_port": (
        int,
        "serve /metrics on this port instead of the gateway's (0, the default: the gateway's)",
    ),
    "metrics_host": (str, "the address of --metrics-port (default: the gateway's --host)"),
}
#: Settings of the gateway's logs, flags of ``kvturn serve`` and ``kvturn up`` alike.
LOG_SETTINGS = ("access_log", "log_level", "log_format")
#: What one tenant may have in flight: flags of ``kvturn serve`` and ``kvturn up`` alike.
CALLER_LIMITS = (
    "caller_requests_in_flight",
    "caller_engine_requests_in_flight",
    "caller_batch_prompts",
)


def add_caller_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--caller-requests-in-flight`` and ``--caller-engine-requests-in-flight`` (``kvturn
    up``; ``kvturn serve`` has them among its other settings)."""
    for name in CALLER_LIMITS:
        kind, text = _GATEWAY_TUNABLES[name]
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=kind, default=None,
            help=f"{text} (default {getattr(GatewayConfig, name)}; env KVTURN_{name.upper()})",
        )  # fmt: skip


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, ``--log-format`` and ``--[no-]access-log``: the gateway's logs."""
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=None,
        help="the gateway's log level (default info; env KVTURN_LOG_LEVEL)",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default=None,
        help="text, or json: one JSON object a line (env KVTURN_LOG_FORMAT)",
    )  # fmt: skip
    parser.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=None,
        help="one log line per request, at INFO (default on; env KVTURN_ACCESS_LOG)",
    )  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    from kvturn.gateway.server import serve

    config, host, port, allow_open = serve_settings(args)
    if config.api_keys.open and not _loopback(host) and not allow_open:
        raise SystemExit(
            f"kvturn serve: refusing to listen on {host} without API keys (anyone who "
            "can reach it could use and end every conversation); set KVTURN_API_KEYS or "
            "KVTURN_API_KEYS_FILE, or pass --allow-open"
        )
    serve(config, host=host, port=port, workers=args.workers)
    return 0


def serve_settings(args: argparse.Namespace) -> tuple[GatewayConfig, str, int, bool]:
    """``kvturn serve``'s gateway settings, address and openness: defaults, then the
    deployment file (``--config``), then ``KVTURN_*`` variables, then flags."""
    from kvturn.gateway.ops.config_file import DeploymentFile, load_deployment

    deployment = load_deployment(args.config) if args.config else DeploymentFile()
    flags: dict[str, object] = {
        name: getattr(args, name) for name in (*_GATEWAY_TUNABLES, *LOG_SETTINGS)
    }
    if args.prefill:
        flags["prefill"] = endpoints(args.prefill, args.prefill_control)
    if args.decode:
        flags["decode"] = endpoints(args.decode, args.decode_control)
    try:
        config = GatewayConfig.from_env(
            base={**deployment.gateway, **deployment.endpoints()},
            api_keys_file=deployment.auth.api_keys_file,
            operator_keys_file=deployment.auth.operator_keys_file,
            **flags,
        )
    except (ValueError, OSError) as error:  # a bad setting, a keys file it cannot read
        raise SystemExit(f"kvturn serve: {error}") from None
    if not config.prefill or not config.decode:
        raise SystemExit(
            "kvturn serve: give at least one prefill and one decode engine (--prefill URL "
            "--decode URL, KVTURN_PREFILL_URLS/KVTURN_DECODE_URLS, or a --config file)"
        )
    host = args.host or deployment.host or "127.0.0.1"
    port = args.port or deployment.port or 8000
    allow_open = bool(args.allow_open or deployment.allow_open)
    return config, host, port, allow_open


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvturn serve``."""
    srv = sub.add_parser("serve", help="run the gateway in front of running engines")
    srv.add_argument("--prefill", action="append", default=[], help="prefill engine URL")
    srv.add_argument("--decode", action="append", default=[], help="decode engine URL")
    srv.add_argument(
        "--decode-control", action="append", default=[],
        help="kvturn control URL of each decode engine, in --decode order",
    )  # fmt: skip
    srv.add_argument(
        "--prefill-control", action="append", default=[],
        help="push: kvturn control URL of each prefill engine, in --prefill order",
    )  # fmt: skip
    srv.add_argument(
        "--config", default=None,
        help="a deployment file (TOML: pools, addresses, auth, settings; flags override it)",
    )  # fmt: skip
    srv.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    srv.add_argument(
        "--workers", type=int, default=1,
        help="gateway processes on the port (share state with --state redis://…)",
    )  # fmt: skip
    srv.add_argument(
        "--allow-open", action="store_true",
        help="listen on a non-loopback address without API keys (anyone may call)",
    )  # fmt: skip
    add_log_flags(srv)
    for name, (kind, text) in _GATEWAY_TUNABLES.items():
        flag = "--" + name.replace("_", "-")
        srv.add_argument(
            flag, dest=name, type=kind, default=None, help=f"{text} (env KVTURN_{name.upper()})"
        )
    srv.set_defaults(func=cmd_serve)
