"""Shared helpers for benchmarks: a local engine pair through ``kvturn up``, CPU accounting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def local_pair(
    model: str = "tiny",
    base_port: int = 28100,
    kv_ttl: int = 480,
    gateway_port: int = 28000,
    kv_cache_gb: int = 4,
    lease_s: float | None = None,
    decode_kv_blocks: int | None = None,
) -> Iterator[dict]:
    """Run ``kvturn up`` (engines + gateway) for the block; yields its state (URLs, pids)."""
    work = Path(tempfile.mkdtemp(prefix="kvturn-bench-"))
    state_file = work / "state.json"
    log = open(work / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvturn.gateway.cli", "up", "--model", model,
         "--base-port", str(base_port), "--kv-ttl", str(kv_ttl), "--port", str(gateway_port),
         "--kv-cache-gb", str(kv_cache_gb),
         "--log-dir", str(work / "logs"), "--state-file", str(state_file),
         *(["--lease-s", str(lease_s)] if lease_s is not None else []),
         *(["--decode-kv-blocks", str(decode_kv_blocks)] if decode_kv_blocks else [])],
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


def cpu_share(leader_pids: list[int], seconds: float) -> float:
    """Average cores used by the engines over ``seconds`` (1.0 = one full core)."""
    before = group_cpu_seconds(leader_pids)
    time.sleep(seconds)
    return (group_cpu_seconds(leader_pids) - before) / seconds
