"""The ``kvturn`` command: ``up`` (local engines and gateway), ``serve`` (the gateway in front
of running engines), ``engine`` (one engine on a host of a deployment), ``models`` (build local
models), ``top`` (watch a gateway)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvturn.gateway.config import GatewayConfig, endpoints, parse_flag
from kvturn.gateway.launch.engines import (
    Deployment,
    EngineError,
    EngineSpec,
    KVSettings,
    max_positions,
    plan_specs,
    start_engines,
)
from kvturn.gateway.launch.local_models import MODEL_NAMES, ensure_model, kvturn_home
from kvturn.gateway.top import add_parser as add_top_parser
from kvturn.wire import CONTROL_SECRET_ENV

if TYPE_CHECKING:
    from kvturn.gateway.server import GatewayThread, GatewayWorkers

#: Tokens per KV block on vLLM-CPU.
CPU_BLOCK_TOKENS = 128


def _resolve_model(name_or_path: str) -> tuple[Path, str]:
    if name_or_path in MODEL_NAMES:
        print(
            f"kvturn: preparing local model {name_or_path!r} (built once, then cached)",
            file=sys.stderr,
            flush=True,
        )
        return ensure_model(name_or_path), name_or_path
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise SystemExit(
            f"kvturn: {name_or_path!r} is neither a local model name "
            f"({', '.join(MODEL_NAMES)}) nor a model directory with config.json"
        )
    return path, path.name


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def engine_specs(args: argparse.Namespace, model: Path, served_name: str) -> list[EngineSpec]:
    """The engines ``kvturn up`` starts for these arguments."""
    kv = KVSettings(
        transfer=args.transfer,
        decoder_kv_blocks_ttl_s=args.kv_ttl,
        kv_recompute_threshold=args.recompute_threshold,
        push_registration_timeout_s=args.push_registration_timeout,
        retain_untracked=args.retain_untracked,
    )
    specs = plan_specs(
        model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        base_port=args.base_port,
        kv=kv,
        served_model_name=served_name,
        prefill_prefix_caching=args.prefill_prefix_cache,
        kv_cache_gb=args.kv_cache_gb,
        device=getattr(args, "device", "cpu"),
    )
    caps = {
        "prefill": getattr(args, "prefill_kv_blocks", None),
        "decode": getattr(args, "decode_kv_blocks", None),
    }
    # A small KV cache, to see retention and eviction under memory pressure: vLLM's
    # block-count override; a request must fit, so the engine's context shrinks with it
    # (vLLM-CPU blocks hold 128 tokens, and vLLM keeps one block as its null block).
    return [
        replace(
            spec,
            max_model_len=min(spec.max_model_len, (blocks - 1) * CPU_BLOCK_TOKENS),
            extra_args=(*spec.extra_args, "--num-gpu-blocks-override", str(blocks)),
        )
        if (blocks := caps.get(spec.role))
        else spec
        for spec in specs
    ]


def up_lease_s(args: argparse.Namespace) -> float | None:
    """The gateway's lease under ``kvturn up``: ``--lease-s`` (or ``KVTURN_LEASE_S``, or the
    gateway's default), never longer than the decodes grant (``--kv-ttl``): the gateway tells
    clients its lease, and they plan their heartbeats from it."""
    asked = args.lease_s
    if asked is None:
        asked = float(os.environ.get("KVTURN_LEASE_S") or GatewayConfig.lease_s)
    if asked > args.kv_ttl:
        if args.lease_s is not None:
            print(
                f"kvturn: --lease-s {asked:g} exceeds --kv-ttl {args.kv_ttl}, the longest lease "
                f"a decode grants: the gateway's lease is {args.kv_ttl} s",
                file=sys.stderr,
            )
        return float(args.kv_ttl)
    return args.lease_s


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The engine ``kvturn engine`` runs for these arguments."""
    local = args.model in MODEL_NAMES or (Path(args.model) / "config.json").exists()
    if local:
        model, served_name = _resolve_model(args.model)
        ours = args.model in MODEL_NAMES
    else:  # a Hugging Face model id, or a path the engine's own host resolves
        model, served_name, ours = Path(args.model), args.model, False
    served_name = args.served_model_name or served_name
    role = args.role
    return EngineSpec(
        role=role,
        model=model,
        port=args.port,
        cpu=args.cpu,
        side_channel_port=args.side_channel_port,
        # Push mode: a prefill's control server tells the gateway its NIXL identity.
        control_port=args.control_port if role == "decode" or args.transfer == "push" else 0,
        host=args.host,
        advertise_host=args.advertise_host,
        device=args.device,
        served_model_name=served_name,
        kv=KVSettings(
            transfer=args.transfer,
            decoder_kv_blocks_ttl_s=args.kv_ttl,
            kv_recompute_threshold=args.recompute_threshold,
            push_registration_timeout_s=args.push_registration_timeout,
            retain_untracked=args.retain_untracked,
        ),
        dtype=args.dtype or ("float32" if ours else "auto"),
        # A model id resolved on the engine's own host: vLLM's default length (the model's).
        max_model_len=args.max_model_len
        or (min(20480, max_positions(model)) if (model / "config.json").exists() else 0),
        kv_cache_gb=args.kv_cache_gb,
        # vLLM's default on both roles (see plan_specs); decode's serves decode-local turns.
        prefix_caching=role == "decode" or args.prefix_cache,
        # kvturn's test models need its chat template and tool parser; other models bring
        # their own (pass their engine flags after --).
        kvturn_chat_template=ours,
        enable_tools=ours,
        # A hub id is downloaded by the engine: the Hugging Face libraries must reach the hub.
        hub_offline=local,
        extra_args=tuple(a for a in args.engine_args if a != "--"),
    )


def cmd_engine(args: argparse.Namespace) -> int:
    """Run one engine in place (``exec``: its pid is this process's), or print its command."""
    try:
        spec = engine_spec(args)
    except ValueError as error:
        raise SystemExit(f"kvturn engine: {error}") from None
    argv, env = spec.command(), spec.environment()
    if args.print:
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changed.items())))
        print(shlex.join(argv))
        return 0
    if spec.role == "decode" and CONTROL_SECRET_ENV not in env:
        print(
            f"kvturn engine: {CONTROL_SECRET_ENV} is not set: this decode's control channel "
            "(lease renew/release) is open to anyone who can reach its port",
            file=sys.stderr,
        )
    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


def cmd_up(args: argparse.Namespace) -> int:
    model, served_name = _resolve_model(args.model)
    specs = engine_specs(args, model, served_name)
    log_dir = Path(args.log_dir) if args.log_dir else kvturn_home() / "logs"
    # Signals turn into an exception so every path below reaches the cleanup.
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    deployment: Deployment | None = None
    gateway: GatewayThread | GatewayWorkers | None = None
    # The decode engines' control channel (lease renew/release/claim) answers only to holders
    # of this secret: generated here unless the operator set one; engines and gateway inherit it.
    os.environ.setdefault(CONTROL_SECRET_ENV, secrets.token_urlsafe(32))
    try:
        print(
            f"kvturn: starting {args.prefill} prefill + {args.decode} decode engine(s) "
            f"({served_name}); logs in {log_dir}",
            flush=True,
        )
        deployment = start_engines(specs, log_dir, timeout_s=args.start_timeout, progress=True)
        if not args.no_gateway:
            from kvturn.gateway.server import GatewayThread

            config = GatewayConfig.from_env(
                prefill=endpoints(
                    [e.spec.url for e in deployment.prefill],
                    [e.spec.control_url or "" for e in deployment.prefill],
                ),
                decode=endpoints(
                    [e.spec.url for e in deployment.decode],
                    [e.spec.control_url or "" for e in deployment.decode],
                ),
                lease_s=up_lease_s(args),
                reuse_threshold_tokens=args.recompute_threshold,
                state=args.state,
                transfer=args.transfer,
            )
            if args.gateway_workers > 1:
                from kvturn.gateway.server import GatewayWorkers

                gateway = GatewayWorkers(
                    config, "127.0.0.1", args.port, args.gateway_workers
                ).start()
            else:
                gateway = GatewayThread(config, port=args.port).start()
        state: dict[str, object] = {
            "model": served_name,
            "model_path": str(model),
            "gateway": f"{gateway.url}/v1" if gateway else None,
            "prefill": [e.spec.url for e in deployment.prefill],
            "decode": [e.spec.url for e in deployment.decode],
            "decode_control": [e.spec.control_url for e in deployment.decode],
            "prefill_control": [e.spec.control_url for e in deployment.prefill],
            "transfer": args.transfer,
            "pids": [e.pid for e in deployment.engines],
            "launcher_pid": os.getpid(),
            "control_secret": os.environ[CONTROL_SECRET_ENV],
        }
        for engine in deployment.engines:
            print(f"kvturn: {engine.spec.role:8s} {engine.spec.url}", flush=True)
        if args.state_file:
            tmp = Path(args.state_file + ".tmp")
            tmp.touch(mode=0o600)  # it holds the control secret
            tmp.write_text(json.dumps(state, indent=2))
            tmp.rename(args.state_file)
        if gateway is not None:
            print(f"kvturn: gateway  {gateway.url}/v1  (point an OpenAI client here)", flush=True)
        print("kvturn: ready; Ctrl-C stops everything", flush=True)
        while True:
            watch = getattr(gateway, "watch", None)  # gateway workers: restart a dead one
            if watch is not None:
                watch()
            for engine in deployment.engines:
                code = engine.exited()
                if code is not None:
                    print(
                        f"kvturn: engine {engine.spec.name} exited with code {code}; "
                        f"last lines of {engine.log_path}:\n{engine.log_tail()}",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(1.0)
    except _Stop as stop:
        print(f"kvturn: {stop}: stopping", flush=True)
        return 0
    except EngineError as error:
        print(f"kvturn: {error}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C must not interrupt the cleanup.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if gateway is not None:
            gateway.stop()
        if deployment is not None:
            deployment.stop()
        if args.state_file:
            Path(args.state_file).unlink(missing_ok=True)
        print("kvturn: all engines stopped", flush=True)


#: Gateway settings that ``kvturn serve`` takes as flags (each also has a KVTURN_* variable).
_GATEWAY_TUNABLES: dict[str, tuple[Callable[[str], object], str]] = {
    "lease_s": (float, "conversation lease without turns or heartbeats, seconds"),
    "expiry_margin_s": (float, "never reuse KV this close to its expiry, seconds"),
    "reuse_threshold_tokens": (int, "reuse only when at least this many tokens are held"),
    "max_conversations": (int, "conversations remembered at once (LRU beyond)"),
    "max_body_bytes": (int, "largest request body accepted"),
    "body_budget_bytes": (int, "request body bytes held at once, all connections (503 past it)"),
    "read_timeout_s": (float, "a request must arrive whole this soon, seconds (else 408)"),
    "max_connections": (int, "client connections open at once (503 past it)"),
    "connect_timeout_s": (float, "engine connect timeout, seconds"),
    "request_timeout_s": (float, "upper bound on one engine request, seconds"),
    "health_interval_s": (float, "engine health-check period, seconds"),
    "publish_wait_s": (float, "wait for decode to publish retained KV, seconds"),
    "decode_local": (parse_flag, "on/off: short turns continue on the decode holding the history"),
    "max_local_suffix_tokens": (int, "longest new suffix a holder decode prefills itself"),
    "max_local_running": (int, "requests a holder may be serving for a decode-local turn"),
    "local_stall_weight": (float, "weight of the delay a local prefill costs other streams"),
    "local_preference": (float, "a local prefill may be predicted this much slower than a pull"),
    "implicit_conversations": (parse_flag, "on/off: find conversations of requests without id"),
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
}


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
    from kvturn.gateway.config_file import DeploymentFile, load_deployment

    deployment = load_deployment(args.config) if args.config else DeploymentFile()
    flags: dict[str, object] = {name: getattr(args, name) for name in _GATEWAY_TUNABLES}
    if args.prefill:
        flags["prefill"] = endpoints(args.prefill, args.prefill_control)
    if args.decode:
        flags["decode"] = endpoints(args.decode, args.decode_control)
    config = GatewayConfig.from_env(
        base={**deployment.gateway, **deployment.endpoints()},
        api_keys_file=deployment.auth.api_keys_file,
        **flags,
    )
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


def cmd_models(args: argparse.Namespace) -> int:
    for name in args.names or MODEL_NAMES:
        if name not in MODEL_NAMES:
            raise SystemExit(
                f"kvturn: unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}"
            )
        print(f"{name}: {ensure_model(name)}")
    return 0


def _add_retain_untracked(parser: argparse.ArgumentParser) -> None:
    """``--retain-untracked``, for ``kvturn up`` and ``kvturn engine`` alike."""
    parser.add_argument(
        "--retain-untracked", action=argparse.BooleanOptionalAction, default=True,
        help="decode: keep the KV of requests no kvturn gateway sent (another proxy's) for "
        "--kv-ttl, as upstream's bidirectional NixlConnector does (off: free it at once)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvturn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start local prefill/decode engines (Ctrl-C stops them)")
    up.add_argument("--model", default="tiny", help="tiny, smollm2, or a model directory")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    up.add_argument("--decode", type=int, default=1, help="number of decode engines")
    up.add_argument("--base-port", type=int, default=8100, help="first engine port")
    up.add_argument("--kv-ttl", type=int, default=480, help="longest decode lease, seconds")
    up.add_argument("--recompute-threshold", type=int, default=64, help="min tokens to pull")
    up.add_argument(
        "--prefill-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's prefix cache on prefill engines (on, vLLM's default; --no-prefill-prefix-"
        "cache: measure what a prefill pool that holds nothing of a conversation sees)",
    )
    up.add_argument("--kv-cache-gb", type=int, default=2, help="KV cache per engine, GiB")
    up.add_argument(
        "--decode-kv-blocks", type=int, default=None,
        help="cap each decode's KV cache at this many blocks (to study memory pressure)",
    )  # fmt: skip
    up.add_argument(
        "--prefill-kv-blocks", type=int, default=None,
        help="cap each prefill's KV cache at this many blocks (to study memory pressure)",
    )  # fmt: skip
    _add_retain_untracked(up)
    up.add_argument("--log-dir", default=None, help="engine logs (default $KVTURN_HOME/logs)")
    up.add_argument("--state-file", default=None, help="write URLs and pids here when ready")
    up.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument("--no-gateway", action="store_true", help="start the engines only")
    up.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="engines on CPU (vllm-cpu) or GPU (the vllm package; never run on a GPU here)",
    )  # fmt: skip
    up.add_argument(
        "--gateway-workers", type=int, default=1,
        help="gateway processes on the port (share state with --state redis://…)",
    )  # fmt: skip
    up.add_argument("--lease-s", type=float, default=None, help="conversation lease, seconds")
    up.add_argument(
        "--transfer", choices=("pull", "push"), default="pull",
        help="prefill→decode KV transfer: pull (decode reads) or push (prefill writes)",
    )  # fmt: skip
    up.add_argument(
        "--push-registration-timeout", type=int, default=60,
        help="push: seconds a decode keeps blocks registered for a push that never came",
    )  # fmt: skip
    up.add_argument(
        "--state", default=None,
        help="gateway state: memory (default) or redis://host:port/db (env KVTURN_STATE)",
    )  # fmt: skip
    up.set_defaults(func=cmd_up)

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
    for name, (kind, text) in _GATEWAY_TUNABLES.items():
        flag = "--" + name.replace("_", "-")
        srv.add_argument(
            flag, dest=name, type=kind, default=None, help=f"{text} (env KVTURN_{name.upper()})"
        )
    srv.set_defaults(func=cmd_serve)

    eng = sub.add_parser(
        "engine",
        help="run one vLLM engine with kvturn's connector on this host (for your own hosts)",
        description="Run one prefill or decode engine in place, with the flags and variables "
        "kvturn's engines need, bound to and advertising this host's address. Flags for vLLM "
        "itself go after --.",
    )
    eng.add_argument("--role", choices=("prefill", "decode"), required=True)
    eng.add_argument(
        "--model", required=True,
        help="tiny or smollm2 (kvturn's local models), a model directory, or a model id",
    )  # fmt: skip
    eng.add_argument("--served-model-name", default=None, help="the name clients ask for")
    eng.add_argument("--host", default="127.0.0.1", help="listen address (API and control)")
    eng.add_argument(
        "--advertise-host", default=None,
        help="the address peers reach this engine at (default --host; needed with 0.0.0.0)",
    )  # fmt: skip
    eng.add_argument("--port", type=int, default=8000, help="the engine's API port")
    eng.add_argument("--side-channel-port", type=int, default=5600, help="NIXL side channel")
    eng.add_argument(
        "--control-port", type=int, default=8300,
        help="kvturn's control server (decode; prefill too with --transfer push)",
    )  # fmt: skip
    eng.add_argument(
        "--transfer", choices=("pull", "push"), default="pull",
        help="the deployment's KV transfer (every engine and the gateway must agree)",
    )  # fmt: skip
    eng.add_argument(
        "--push-registration-timeout", type=int, default=60,
        help="push, decode: seconds it keeps blocks registered for a push that never came",
    )  # fmt: skip
    eng.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="KV cache device")
    eng.add_argument("--cpu", type=int, default=None, help="pin the engine to this core")
    eng.add_argument("--dtype", default=None, help="default: float32 for kvturn's models")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--kv-cache-gb", type=int, default=2, help="CPU KV cache, GiB")
    eng.add_argument("--kv-ttl", type=int, default=480, help="longest decode lease, seconds")
    eng.add_argument(
        "--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
        help="vLLM's prefix cache on a prefill engine (a decode always keeps it)",
    )  # fmt: skip
    _add_retain_untracked(eng)
    eng.add_argument("--recompute-threshold", type=int, default=64, help="min tokens to pull")
    eng.add_argument("--print", action="store_true", help="print the command, do not run it")
    eng.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then vLLM's own flags")
    eng.set_defaults(func=cmd_engine)

    models = sub.add_parser("models", help="build the local models (tiny, smollm2)")
    models.add_argument("names", nargs="*", help=f"any of {', '.join(MODEL_NAMES)} (default all)")
    models.set_defaults(func=cmd_models)

    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
