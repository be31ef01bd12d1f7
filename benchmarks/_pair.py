"""Shared helpers for benchmarks: a local engine pair through ``kvturn up``, a server process
for the length of a block, CPU accounting."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]


def shown(command: tuple[str, ...]) -> str:
    """A command as a shell line, paths inside the repository made relative."""
    return shlex.join(os.path.relpath(part, ROOT) if part.startswith(str(ROOT)) else part
                      for part in command)  # fmt: skip


@contextlib.contextmanager
def server(
    *command: str,
    port: int,
    http: bool = True,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running (from the repository root) until the block ends, once it answers
    ``/health`` (or, not ``http``, once it accepts connections); yields its process."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec_fn,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if not http:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except (httpx.HTTPError, OSError):
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{shown(command)} did not come up on :{port}\n{tail}")
                time.sleep(0.1)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def local_pair(
    model: str = "tiny",
    base_port: int = 28100,
    kv_ttl: int = 480,
    gateway_port: int = 28000,
    kv_cache_gb: int = 4,
    lease_s: float | None = None,
    decode_kv_blocks: int | None = None,
    transfer: str = "pull",
    prefill_prefix_cache: bool = False,
    extra_args: tuple[str, ...] = (),
) -> Iterator[dict]:
    """Run ``kvturn up`` (engines + gateway) for the block; yields its state (URLs, pids).

    Prefill runs without a prefix cache unless ``prefill_prefix_cache``: the benchmarks
    written before it was on by default measure a prefill pool that holds nothing of a
    conversation (their recompute modes recompute), and keep doing so."""
    work = Path(tempfile.mkdtemp(prefix="kvturn-bench-"))
    state_file = work / "state.json"
    log = open(work / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvturn.gateway.ops.cli", "up", "--model", model,
         "--base-port", str(base_port), "--kv-ttl", str(kv_ttl), "--port", str(gateway_port),
         "--kv-cache-gb", str(kv_cache_gb), "--transfer", transfer,
         "--log-dir", str(work / "logs"), "--state-file", str(state_file),
         *(["--lease-s", str(lease_s)] if lease_s is not None else []),
         *(["--decode-kv-blocks", str(decode_kv_blocks)] if decode_kv_blocks else []),
         *([] if prefill_prefix_cache else ["--no-prefill-prefix-cache"]), *extra_args],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        while not state_file.exists():
            if proc.poll() is not None:
                raise RuntimeError((work / "up.log").read_text())
            time.sleep(1)
        yield json.loads(state_file.read_text())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        log.close()


def group_cpu_seconds(leader_pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by every process in the leaders' process groups."""
    groups = {os.getpgid(p) for p in leader_pids}
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # Fields after the command: state(0) ppid(1) pgrp(2) ... utime(11) stime(12)
        if int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU time (user and system, every thread) of these processes and their children so far
    (a gateway's worker processes are its children)."""
    total = 0
    seen: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # gone meanwhile
        total += int(stat[11]) + int(stat[12])
    return total / CLOCK_TICKS


def cpu_share(leader_pids: list[int], seconds: float) -> float:
    """Average cores used by the engines over ``seconds`` (1.0 = one full core)."""
    before = group_cpu_seconds(leader_pids)
    time.sleep(seconds)
    return (group_cpu_seconds(leader_pids) - before) / seconds
