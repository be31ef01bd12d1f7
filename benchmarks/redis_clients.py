"""Maintained asyncio Redis clients on the gateway's own Redis work: what a turn's table calls
cost in latency and in the gateway's CPU.

A turn with Redis state makes three calls, each one of the table's Lua scripts (EVALSHA): take
the conversation's KV as the turn starts, mark the reply as settling when it starts, record
where its KV stays after it. This runs exactly those scripts (``kvturn/gateway/state/scripts/``,
read as the gateway reads them) against a ``redis-server`` of its own on loopback, on uvloop as
the gateway runs, with each client:

- redis-py with hiredis's reply parser (what the gateway uses),
- coredis,
- valkey-glide (its core is Rust, on threads of its own: its CPU is counted too, as this
  process's CPU is).

At concurrency 1 (turns one after another: the latency a turn's calls add) and at concurrency
32 (turns/s, and CPU per turn of this process and of redis-server). The clients are not
kvturn dependencies: they live in a virtualenv of their own (an ignored path), which runs this:

    python3 -m venv .venv-redis-clients
    .venv-redis-clients/bin/pip install redis==8.1.0 hiredis==3.4.2 coredis==6.9.0 \\
        valkey-glide==2.5.3 uvloop==0.23.0
    .venv-redis-clients/bin/python benchmarks/redis_clients.py

Results: benchmarks/results/redis_clients.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "redis_clients.md"
SCRIPTS = ("take", "settling", "record")
CLIENTS = ("redis-py", "coredis", "valkey-glide")
CONVERSATIONS = 64


def table_scripts() -> dict[str, str]:
    """The table's Lua scripts, as the gateway loads them (:mod:`kvturn.gateway.state.lua`,
    standard library only: the clients' virtualenv has no kvturn installed, so the checkout's
    is put on the path)."""
    sys.path.insert(0, str(ROOT))
    from kvturn.gateway.state.lua import script

    return {name: script(name) for name in SCRIPTS}


def turn_calls(i: int) -> list[tuple[str, list[str], list[Any]]]:
    """A turn's three calls, as the gateway makes them (keys and arguments)."""
    now = time.time()
    entry = f"bench:conv:c{i % CONVERSATIONS}"
    # epoch, turn, ttl ms, now, a fresh turn's conversation id and implicit index value (none),
    # holder, request id, tokens, digest, digest tokens, salt, expires at, prompt mark
    held = [7, i, 600000, now, "", "", "http://127.0.0.1:8200", f"kvturn-{i:032x}", 1234,
            "ab" * 12, 1152, "", now + 30, "cd" * 12]  # fmt: skip
    return [
        ("take", [entry, "bench:live", "bench:seen"], [f"c{i}", "", now, 600000, 7, ""]),
        ("settling", [entry, "bench:seen", ""], [i, now, 600000, "", "", ""]),
        ("record", [entry, "bench:live", "bench:seen", ""], held),
    ]


Call = Callable[[str, list[str], list[Any]], Awaitable[Any]]


async def connect(client: str, port: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    """``call(script, keys, args)`` and ``close()`` for one client."""
    scripts = table_scripts()
    url = f"redis://127.0.0.1:{port}/0"
    if client == "redis-py":
        import redis.asyncio

        r = redis.asyncio.Redis.from_url(url)
        registered = {name: r.register_script(code) for name, code in scripts.items()}

        async def call(name: str, keys: list[str], args: list[Any]) -> Any:
            return await registered[name](keys=keys, args=args)

        return call, r.aclose
    if client == "coredis":
        import coredis

        c = coredis.Redis.from_url(url)
        await c.__aenter__()  # coredis 6 runs its connections in the client's context
        on_coredis = {name: c.register_script(code) for name, code in scripts.items()}

        async def call_coredis(name: str, keys: list[str], args: list[Any]) -> Any:
            return await on_coredis[name](keys=keys, args=args)

        async def close_coredis() -> None:
            await c.__aexit__(None, None, None)

        return call_coredis, close_coredis
    from glide import GlideClient, GlideClientConfiguration, NodeAddress, Script

    g = await GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))
    on_glide = {name: Script(code) for name, code in scripts.items()}

    async def call_glide(name: str, keys: list[str], args: list[Any]) -> Any:
        return await g.invoke_script(on_glide[name], keys=keys, args=[str(a) for a in args])

    return call_glide, g.close


# The helpers of benchmarks/_pair.py (a server until it answers, CPU of a process tree) are not
# used here: they import httpx, which the clients' virtualenv does not have.


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user and system, all threads) of this process, or of ``pid``."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(client: str, port: int, server_pid: int, n1: int, n32: int) -> dict[str, float]:
    call, close = await connect(client, port)

    async def turn(i: int) -> None:
        for name, keys, args in turn_calls(i):
            await call(name, keys, args)

    try:
        for i in range(300):  # warm-up: connections, script cache
            await turn(i)
        latencies = []
        cpu = cpu_seconds()
        for i in range(n1):
            started = time.perf_counter()
            await turn(i)
            latencies.append(time.perf_counter() - started)
        found = {
            "c1_p50_us": statistics.median(latencies) * 1e6,
            "c1_cpu_us": (cpu_seconds() - cpu) / n1 * 1e6,
        }
        counter = iter(range(n32))

        async def worker() -> None:
            for i in counter:
                await turn(i)

        cpu, server_cpu = cpu_seconds(), cpu_seconds(server_pid)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        wall = time.perf_counter() - started
        found["c32_turns_s"] = n32 / wall
        found["c32_cpu_us"] = (cpu_seconds() - cpu) / n32 * 1e6
        found["c32_server_us"] = (cpu_seconds(server_pid) - server_cpu) / n32 * 1e6
        return found
    finally:
        await close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def version(client: str) -> str:
    package = {"redis-py": "redis"}.get(client, client)
    extra = f" + hiredis {metadata.version('hiredis')}" if client == "redis-py" else ""
    return f"{client} {metadata.version(package)}{extra}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the clients")
    parser.add_argument("--quick", action="store_true", help="fewer turns (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="Markdown results file")
    args = parser.parse_args()
    n1, n32 = (300, 1500) if args.quick else (2000, 10000)
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        print("no redis-server on PATH (make setup installs it)", file=sys.stderr)
        return 2
    port = free_port()
    server = subprocess.Popen(
        [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in CLIENTS}
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        for r in range(args.rounds):
            for client in CLIENTS if r % 2 == 0 else reversed(CLIENTS):
                found = uvloop.run(measure(client, port, server.pid, n1, n32))
                rows[client].append(found)
                print(client, {k: round(v, 1) for k, v in found.items()}, flush=True)
        redis_version = subprocess.run(
            [redis_server, "--version"], capture_output=True, text=True
        ).stdout.split()[2]
    finally:
        server.terminate()
        server.wait(10)
    took = time.monotonic() - started
    lines = [
        "# Redis clients on the gateway's table calls"
        + (" — QUICK smoke run" if args.quick else ""),
        "",
        f"Command: `.venv-redis-clients/bin/python benchmarks/redis_clients.py"
        f"{' --quick' if args.quick else ''}` ({took:.0f} s)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores; Redis "
        f"{redis_version} on loopback (no persistence); Python {sys.version.split()[0]} on "
        f"uvloop {metadata.version('uvloop')}.  ",
        "A turn = the gateway's three table calls (take, settling, record: EVALSHA of its Lua "
        f"scripts) on {CONVERSATIONS} rotating conversations. Concurrency 1: {n1} turns one "
        "after another (p50 of a turn's three calls, and this process's CPU per turn). "
        f"Concurrency 32: {n32} turns (turns/s; CPU per turn of this process, all threads, and "
        f"of redis-server). Median of {args.rounds} rounds, the clients alternating.",
        "",
        "| client | c=1 p50 per turn | c=1 CPU per turn | c=32 turns/s | c=32 CPU per turn "
        "| c=32 redis-server CPU per turn |",
        "|---|---|---|---|---|---|",
    ]
    for client, found in rows.items():
        m = {k: statistics.median(f[k] for f in found) for k in found[0]}
        lines.append(
            f"| {version(client)} | {m['c1_p50_us']:.0f} µs | {m['c1_cpu_us']:.0f} µs "
            f"| {m['c32_turns_s']:.0f} | {m['c32_cpu_us']:.0f} µs | {m['c32_server_us']:.0f} µs |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
