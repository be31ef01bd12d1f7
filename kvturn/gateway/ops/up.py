"""``kvturn up``: local prefill and decode engines and a gateway in front of them, in the
foreground until Ctrl-C (or an engine exits), everything stopped on the way out."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.engine import add_retain_untracked
from kvturn.gateway.ops.launch.engines import (
    Deployment,
    EngineError,
    EngineSpec,
    KVSettings,
    plan_specs,
    start_engines,
)
from kvturn.gateway.ops.launch.local_models import kvturn_home
from kvturn.gateway.ops.models import resolve_model
from kvturn.gateway.ops.serve import (
    CALLER_LIMITS,
    LOG_SETTINGS,
    add_caller_limit_flags,
    add_log_flags,
)
from kvturn.wire import CONTROL_SECRET_ENV

if TYPE_CHECKING:
    from kvturn.gateway.server import GatewayThread, GatewayWorkers

#: Tokens per KV block on vLLM-CPU.
CPU_BLOCK_TOKENS = 128


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


def cmd_up(args: argparse.Namespace) -> int:
    model, served_name = resolve_model(args.model)
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
            from kvturn.gateway.server import GatewayThread, configure_logging

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
                heartbeat_lease_s=args.heartbeat_lease_s,
                reuse_threshold_tokens=args.recompute_threshold,
                state=args.state,
                transfer=args.transfer,
                **{name: getattr(args, name, None) for name in (*LOG_SETTINGS, *CALLER_LIMITS)},
            )
            configure_logging(config.log_level, config.log_format)
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvturn up``."""
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
    add_retain_untracked(up)
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
        "--heartbeat-lease-s", type=float, default=None,
        help="lease of a conversation whose client sends heartbeats, seconds (default 5)",
    )  # fmt: skip
    up.add_argument(
        "--transfer", choices=("pull", "push"), default="pull",
        help="prefill→decode KV transfer: pull (decode reads) or push (prefill writes)",
    )  # fmt: skip
    up.add_argument(
        "--push-registration-timeout", type=int, default=60,
        help="push: seconds a decode keeps blocks registered for a push that never came",
    )  # fmt: skip
    add_log_flags(up)
    add_caller_limit_flags(up)
    up.add_argument(
        "--state", default=None,
        help="gateway state: memory (default) or redis://host:port/db (env KVTURN_STATE)",
    )  # fmt: skip
    up.set_defaults(func=cmd_up)
