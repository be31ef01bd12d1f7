"""Shared helpers for benchmarks: a local engine pair through ``kvturn up``, a server process
for the length of a block, "vLLM P/D as deployed" (vllm-router in front of the same engines),
the engines' token counters, CPU accounting, the spread of repeated runs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]
#: vllm-router pins its own dependencies: a venv of its own
#: (``python3.11 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17``).
ROUTER_BIN = ROOT / ".venv-router" / "bin" / "vllm-router"
ROUTER_PORT = 29300
#: The session-affinity header vllm-router's ``consistent_hash`` policy keys on; the kvturn
#: gateway takes it as a conversation id where ``X-Conversation-Id`` is absent.
SESSION_HEADER = "X-Session-ID"


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
    ``/health`` (or, not ``http``, once it accepts connections); yields its process. The port
    must be free first: a process left on it by an interrupted run would answer in its place."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        raise RuntimeError(f"port {port} is taken: another process would answer for {command[0]}")
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


@contextlib.contextmanager
def router(prefill: list[str], decode: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """vllm-router in P/D mode in front of these engines for the block, session affinity by
    ``consistent_hash`` on ``X-Session-ID``; yields its process and its command line."""
    command = [
        str(ROUTER_BIN), "--vllm-pd-disaggregation",
        *[a for url in prefill for a in ("--prefill", url)],
        *[a for url in decode for a in ("--decode", url)],
        "--policy", "consistent_hash",
        "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
        "--prometheus-port", str(ROUTER_PORT + 91),
        "--request-timeout-secs", "3600",
    ]  # fmt: skip
    with server(*command, port=ROUTER_PORT, env={"OPENAI_API_KEY": ""}) as proc:
        yield proc, shown(tuple(command))


@contextlib.contextmanager
def as_deployed(
    extra_args: tuple[str, ...] = (), **pair: Any
) -> Iterator[tuple[dict[str, Any], str]]:
    """The engines of one ``kvturn up`` (its gateway too) set up as "vLLM P/D as deployed" can
    also run on them: prefill with vLLM's prefix cache on, decode keeping nothing of a request
    no kvturn gateway sent (``--no-retain-untracked``: plain P/D has no bidirectional
    retention), and vllm-router (:func:`router`) in front of them at ``ROUTER_PORT``. Yields the
    pair's state and the router's command line. ``pair``: :func:`local_pair`'s settings."""
    if not ROUTER_BIN.exists():
        raise SystemExit(f"{ROUTER_BIN} is missing: python3.11 -m venv .venv-router && "
                         ".venv-router/bin/pip install vllm-router==0.1.17")  # fmt: skip
    with (
        local_pair(
            prefill_prefix_cache=True, extra_args=("--no-retain-untracked", *extra_args), **pair
        ) as state,
        router(state["prefill"], state["decode"]) as (_, command),
    ):
        yield state, command


# ---- engine counters ---------------------------------------------------------------------------


def _samples(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` in Prometheus text, by its label string."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            head, value = line.rsplit(" ", 1)
            found[head[len(name) :]] = found.get(head[len(name) :], 0.0) + float(value)
    return found


def engine_counters(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by where they came from, summed over ``urls``: ``computed`` (local
    compute), ``cached`` (the engine's own prefix cache), ``received`` (over NIXL)."""
    totals = {"computed": 0.0, "cached": 0.0, "received": 0.0}
    keys = {"local_compute": "computed", "local_cache_hit": "cached"}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for labels, value in _samples(text, "vllm:prompt_tokens_by_source_total").items():
            source = labels.split('source="', 1)[1].split('"', 1)[0] if "source=" in labels else ""
            totals[keys.get(source, "received")] += value
    return totals


def engine_totals(urls: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """Each metric of ``names`` summed over its samples and over ``urls`` (counters, or a
    histogram's ``_sum``/``_count``)."""
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for name in names:
            totals[name] += sum(_samples(text, name).values())
    return totals


#: What a decode engine spent its steps on: every token its steps ran (prompt and generated),
#: the generated ones, and its preemptions (each a running request pushed out to be recomputed).
DECODE_WORK = (
    "vllm:iteration_tokens_total_sum",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)


def gateway_plans(url: str, name: str = "kvturn_turns_total") -> dict[str, float]:
    """The gateway's turns so far, by plan (``name``: another of its metrics by plan, e.g.
    ``kvturn_ttft_seconds_sum``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    plans: dict[str, float] = {}
    for labels, value in _samples(text, name).items():
        plan = labels.split('plan="', 1)[1].split('"', 1)[0]
        plans[plan] = plans.get(plan, 0.0) + value
    return plans


def gateway_plan_reasons(url: str) -> dict[str, float]:
    """The gateway's turns so far, by ``plan/reason`` (``recompute/first-turn``...)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    reasons: dict[str, float] = {}
    for labels, value in _samples(text, "kvturn_turn_plans_total").items():
        plan = labels.split('plan="', 1)[1].split('"', 1)[0]
        reason = labels.split('reason="', 1)[1].split('"', 1)[0]
        reasons[f"{plan}/{reason}"] = reasons.get(f"{plan}/{reason}", 0.0) + value
    return reasons


def gateway_total(url: str, name: str) -> float:
    """A gateway counter's value, every label together (0 where it has none yet)."""
    return sum(_samples(httpx.get(f"{url}/metrics", timeout=30).text, name).values())


def wait_idle(urls: list[str], timeout_s: float = 120) -> None:
    """Until no engine runs or queues a request (a run's last streams may still be ending)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            text = httpx.get(f"{url}/metrics", timeout=30).text
            busy += sum(_samples(text, "vllm:num_requests_running").values())
            busy += sum(_samples(text, "vllm:num_requests_waiting").values())
        if busy == 0:
            return
        time.sleep(1)


# ---- repeated runs -----------------------------------------------------------------------------


def interleaved(modes: tuple[str, ...], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, mode) in the order the runs go: every mode once a repeat, the order reversed
    from one repeat to the next."""
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else tuple(reversed(modes)):
            yield repeat, mode


def spread(values: list[float]) -> str:
    """Median (min-max) of repeated runs' values."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def ratio(kv: list[float], base: list[float]) -> str:
    """Median ratio, with the range of ratios of every kvturn run to every baseline run: a
    range that straddles 1.0 is a tie."""
    if not kv or not base:
        return "-"
    ratios = sorted(k / b for k in kv for b in base if b)
    return (
        f"{statistics.median(kv) / statistics.median(base):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
    )


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


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user and system, every thread) of this one process so far, not its children."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy (not idle or waiting on I/O) since
    boot, from ``/proc/stat``: over a run, what everything on the machine used."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def cpu_share(leader_pids: list[int], seconds: float) -> float:
    """Average cores used by the engines over ``seconds`` (1.0 = one full core)."""
    before = group_cpu_seconds(leader_pids)
    time.sleep(seconds)
    return (group_cpu_seconds(leader_pids) - before) / seconds


def engine_itl_buckets(urls: list[str]) -> dict[float, float]:
    """vLLM's own inter-token latency histogram (``vllm:inter_token_latency_seconds``),
    cumulative counts by upper bound, summed over ``urls``: what the engines measured between
    the tokens they produced, before any router relays them."""
    buckets: dict[float, float] = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for labels, value in _samples(text, "vllm:inter_token_latency_seconds_bucket").items():
            bound = labels.split('le="', 1)[1].split('"', 1)[0]
            le = float("inf") if bound == "+Inf" else float(bound)
            buckets[le] = buckets.get(le, 0.0) + value
    return buckets


def histogram_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """The ``q`` quantile (seconds) of what a cumulative histogram counted between two
    scrapes, linear within a bucket as Prometheus's ``histogram_quantile`` does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return None


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) every live process has used, by its command line's first
    120 characters: a run's share of the machine by process, from two snapshots."""
    import psutil

    used: dict[str, float] = {}
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        times = process.info.get("cpu_times")
        cmdline = " ".join(process.info.get("cmdline") or [])
        if times is None or not cmdline:
            continue
        with contextlib.suppress(psutil.Error):  # an engine's children: under its server's line
            for parent in process.parents():
                if "--port" in (line := " ".join(parent.cmdline())):
                    cmdline = f"{line} <- {cmdline}"
                    break
        key = cmdline[:200]
        used[key] = used.get(key, 0.0) + times.user + times.system
    return used
