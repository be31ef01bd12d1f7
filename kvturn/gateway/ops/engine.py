"""``kvturn engine``: one vLLM engine with kvturn's connector on this host, run in place (or
its command printed), for deployments on the operator's own hosts."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from kvturn.gateway.ops.launch.engines import EngineSpec, KVSettings, max_positions
from kvturn.gateway.ops.launch.local_models import MODEL_NAMES
from kvturn.gateway.ops.models import resolve_model
from kvturn.wire import CONTROL_SECRET_ENV


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The engine ``kvturn engine`` runs for these arguments."""
    local = args.model in MODEL_NAMES or (Path(args.model) / "config.json").exists()
    if local:
        model, served_name = resolve_model(args.model)
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
            insecure_control=args.insecure_control,
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
    if spec.control_port and not env.get(CONTROL_SECRET_ENV):
        if not args.insecure_control:
            raise SystemExit(
                f"kvturn engine: {CONTROL_SECRET_ENV} is not set: this engine's control channel "
                "(lease renew/release/claim) would be open to anyone who can reach its port. "
                "Set the secret the gateway shares, or pass --insecure-control to run it open."
            )
        print(
            f"kvturn engine: {CONTROL_SECRET_ENV} is not set: this engine's control channel "
            "(lease renew/release/claim) is open to anyone who can reach its port",
            file=sys.stderr,
        )
    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


def add_retain_untracked(parser: argparse.ArgumentParser) -> None:
    """``--retain-untracked``, for ``kvturn up`` and ``kvturn engine`` alike."""
    parser.add_argument(
        "--retain-untracked", action=argparse.BooleanOptionalAction, default=True,
        help="decode: keep the KV of requests no kvturn gateway sent (another proxy's) for "
        "--kv-ttl, as upstream's bidirectional NixlConnector does (off: free it at once)",
    )  # fmt: skip


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvturn engine``."""
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
    add_retain_untracked(eng)
    eng.add_argument("--recompute-threshold", type=int, default=64, help="min tokens to pull")
    eng.add_argument(
        "--insecure-control", action="store_true",
        help=f"run the control channel without {CONTROL_SECRET_ENV} (open to anyone who can "
        "reach its port); without the secret and this flag the engine refuses to start",
    )  # fmt: skip
    eng.add_argument("--print", action="store_true", help="print the command, do not run it")
    eng.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then vLLM's own flags")
    eng.set_defaults(func=cmd_engine)
