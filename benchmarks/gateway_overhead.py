"""Latency the gateway adds, and its peak request rate, against a fast fake upstream; the Rust
vllm-router (PyPI ``vllm-router``, P/D mode) measured the same way for comparison.

    .venv/bin/python benchmarks/gateway_overhead.py [--quick]

A fast fake engine (``benchmarks/fast_upstream.py``: canned answers, prefill and decode roles)
runs in one process, the gateway (``kvturn serve``) in another, vllm-router in a third, the load
generator (kvturn's lean HTTP/1.1 client on uvloop) here. "direct" is the same P/D exchange
done by the load generator itself (prefill, then decode with the returned params), so "added" is
what a router costs on top of the two hops it replaces. vllm-router lives in its own
virtualenv so it cannot disturb kvturn's packages:

    python3 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17

(without it, or with --no-router, its columns are left out). A second gateway with its state in
Redis (``--state redis://…``, a ``redis-server`` of its own on loopback) is measured beside the
first (without ``redis-server``, or with --no-redis, it is left out), and a third with implicit
conversations off: the requests carry no conversation id, which by default the gateway still
tracks as conversations (vllm-router tracks nothing), so this one shows what that costs. For
concurrency 32 and 256 the CPU each router's processes used per request is reported too (one
Python process is capped at one core; vllm-router is multi-threaded). With --servers, the same
gateway app is also served whole by maintained ASGI servers (``benchmarks/asgi_gateway.py``):
uvicorn with httptools, uvicorn with h11, and granian if it is installed
(``.venv/bin/pip install granian==2.8.7``; not a kvturn dependency). With --workers N, the
gateway also runs as N worker processes on one port sharing one Redis table (``kvturn serve
--workers N --state redis://…``), which is how it uses more than one core. With Redis,
concurrency 1 runs once more paced (the load generator idle between requests): what a turn
waits for Redis, apart from the CPU its calls take from the next request. Results:
benchmarks/results/gateway_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvloop

from kvturn.gateway.http.client import HttpClient
from kvturn.wire import PREFILL_FOR_REMOTE_DECODE

sys.path.insert(0, str(Path(__file__).parent))
from _pair import server, shown, tree_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gateway_overhead.md"
ROUTER_BIN = ROOT / ".venv-router" / "bin" / "vllm-router"
GATEWAY_PORT, FAKE_PORT, ROUTER_PORT, ROUTER_METRICS_PORT = 29000, 29001, 29002, 29003
GATEWAY_REDIS_PORT, REDIS_PORT = 29004, 29005
#: The gateway app under other ASGI servers (--servers): kind → port.
SERVER_PORTS = {"uvicorn-httptools": 29006, "uvicorn-h11": 29007, "granian": 29008}
#: The gateway as several worker processes sharing one Redis table (--workers N).
WORKERS_KIND, WORKERS_PORT = "gateway-workers", 29009
#: The gateway without implicit conversations: a request without an id is relayed P/D and
#: tracked by nothing (vllm-router's work), beside the default that tracks it.
UNTRACKED_KIND, UNTRACKED_PORT = "gateway-untracked", 29010
LEVELS = (1, 32, 256)
#: Concurrency 1 once more with the load generator idle this long after each request: what
#: Redis costs a turn with the machine's cores free (see write_paced_results).
PACED_GAP_S = 0.002
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 2}
PREFILL = PREFILL_FOR_REMOTE_DECODE
PORTS = {
    "gateway": GATEWAY_PORT,
    "gateway-redis": GATEWAY_REDIS_PORT,
    "router": ROUTER_PORT,
    **SERVER_PORTS,
    WORKERS_KIND: WORKERS_PORT,
    UNTRACKED_KIND: UNTRACKED_PORT,
}
JSON = {"content-type": "application/json"}

ROUTER_NOTES = """\
How vllm-router's P/D mode works (`--vllm-pd-disaggregation`, default `--kv-connector nixl`;
read from its requests as the fake engine received them): for each client request, one after
the other, never concurrently,
1. `POST <prefill>/v1/chat/completions` with the client's body re-serialized through its typed
   request (defaults added: `logprobs`, `skip_special_tokens`, `ignore_eos`...; unknown fields
   kept), `stream=false`, `max_tokens=1`, `min_tokens=1`, `stream_options` removed, and
   `kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id,
   remote_block_ids, remote_host, remote_port: null}`; it waits for the whole JSON answer;
2. `POST <decode>/v1/chat/completions` with the client's body (its own `max_tokens`, `stream`)
   plus the prefill answer's `kv_transfer_params` copied verbatim, and relays the decode answer
   as it comes (SSE chunks passed on one by one, not buffered).
Both carry `X-Request-Id: ___prefill_addr_<host:port>___decode_addr_<host:port>_<uuid>` and
`Authorization: Bearer $OPENAI_API_KEY` (empty here). At start-up it GETs `/health` and
`/metrics` of each worker (it counts the `engine="N"` labels to find DP ranks; the fake answers
one engine), then `/health` every 60 s; its own `/health` does not call the workers.
Setup notes: it keys workers by URL, so the same URL as `--prefill` and `--decode` leaves no
prefill worker (503 "No available workers: 0 prefill, 1 decode"): the one fake process is named
`http://localhost:29001` as prefill and `http://127.0.0.1:29001` as decode. Its Prometheus
exporter defaults to port 29000, the gateway's port here, hence `--prometheus-port`. Policy
`round_robin`: with one prefill and one decode worker every policy picks the same ones, and
round robin is the cheapest. Before its measurements, 300 requests through vllm-router check
the fake's `/fake/counts`: exactly one prefill and one decode per request.
"""


async def one_direct(client: HttpClient, stream: bool) -> float:
    base = f"http://127.0.0.1:{FAKE_PORT}/v1/chat/completions"
    started = time.perf_counter()
    prefill = {**BODY, "max_tokens": 1, "kv_transfer_params": PREFILL}
    answer = await client.request("POST", base, orjson.dumps(prefill), JSON)
    params = orjson.loads(answer.body)["kv_transfer_params"]
    decode = {**BODY, "stream": stream, "kv_transfer_params": params}
    await _read(client, base, orjson.dumps(decode), JSON)
    return time.perf_counter() - started


async def one_routed(client: HttpClient, port: int, stream: bool, cid: str | None) -> float:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {**JSON, "X-Conversation-Id": cid} if cid else JSON
    started = time.perf_counter()
    await _read(client, url, orjson.dumps({**BODY, "stream": stream}), headers)
    return time.perf_counter() - started


async def _read(client: HttpClient, url: str, body: bytes, headers: dict[str, str]) -> None:
    """POST and read the answer chunk by chunk as it arrives (a stream's SSE events too)."""
    async with await client.open("POST", url, body, headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.read()!r}")
        while await response.next_chunk() is not None:
            pass


async def call(client: HttpClient, kind: str, stream: bool, i: int) -> float:
    if kind == "direct":
        return await one_direct(client, stream)
    cid = f"bench-{i % 64}" if kind.endswith("+cid") else None
    return await one_routed(client, PORTS[kind.split("+")[0]], stream, cid)


def summary(latencies: list[float], rps: float) -> dict[str, Any]:
    latencies = sorted(latencies)
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[max(0, math.ceil(len(latencies) * 0.99) - 1)] * 1000,
        "rps": rps,
        "n": len(latencies),
    }


async def sequential(
    kinds: list[str], stream: bool, n: int, gap_s: float = 0.0
) -> dict[str, dict[str, Any]]:
    """Concurrency 1, the kinds interleaved request by request (rotating which goes first), so
    that a slow moment of this shared machine lands on all of them alike; ``gap_s`` idle after
    each request (req/s is still 1 / mean latency)."""
    client = HttpClient(timeout_s=60)
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for i in range(200):  # warm-up: connection pools, caches
            for kind in kinds:
                await call(client, kind, stream, i)
        for i in range(n):
            for j in range(len(kinds)):
                kind = kinds[(i + j) % len(kinds)]
                latencies[kind].append(await call(client, kind, stream, i))
                if gap_s:
                    await asyncio.sleep(gap_s)
    finally:
        await client.close()
    return {k: summary(v, len(v) / sum(v)) for k, v in latencies.items()}


async def concurrent(
    kinds: list[str],
    stream: bool,
    concurrency: int,
    n: int,
    rounds: int,
    pids: dict[str, list[int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``concurrency`` workers, ``n`` requests per kind split over ``rounds`` rounds that
    alternate the kinds; req/s is the median round's, latencies are pooled. For a kind in
    ``pids`` (its server processes), the CPU they used in its rounds: per request, and in
    cores (CPU seconds over wall seconds)."""
    client = HttpClient(timeout_s=60)
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    used = {kind: [0.0, 0.0, 0] for kind in kinds}  # CPU s, wall s, requests
    pids = pids or {}

    async def run(kind: str, count: int, into: list[float]) -> float:
        counter = iter(range(count))

        async def worker() -> None:
            for i in counter:
                into.append(await call(client, kind, stream, i))

        cpu = tree_cpu_seconds(pids.get(kind, []))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        if into is latencies[kind]:
            used[kind][0] += tree_cpu_seconds(pids.get(kind, [])) - cpu
            used[kind][1] += wall
            used[kind][2] += count
        return count / wall

    try:
        for kind in kinds:  # warm-up: opens the pools of the client and the router under test
            await run(kind, max(200, 2 * concurrency), [])
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else reversed(kinds):
                rates[kind].append(await run(kind, n // rounds, latencies[kind]))
    finally:
        await client.close()
    found = {k: summary(latencies[k], statistics.median(rates[k])) for k in kinds}
    for kind in pids:
        if kind in found:
            cpu, wall, count = used[kind]
            found[kind]["cpu_us"] = cpu / count * 1e6
            found[kind]["cores"] = cpu / wall
    return found


def fake_counts() -> dict[str, int]:
    return httpx.get(f"http://127.0.0.1:{FAKE_PORT}/fake/counts", timeout=5).json()


def check_router_does_pd(stream: bool, n: int = 100) -> None:
    """vllm-router must send one prefill and one decode per request, like the gateway."""
    before = fake_counts()
    uvloop.run(concurrent(["router"], stream, 1, n, 1))
    after = fake_counts()
    seen = {role: after[role] - before[role] for role in ("prefill", "decode")}
    calls = n + 200  # with the warm-up
    if seen != {"prefill": calls, "decode": calls}:
        raise RuntimeError(f"vllm-router did not do P/D: {calls} requests, fake saw {seen}")


def router_version(binary: Path) -> str:
    python = binary.parent / "python"
    code = "import importlib.metadata as m; print(m.version('vllm-router'))"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _cells(r: dict[str, Any], direct: dict[str, Any]) -> str:
    return (
        f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['rps']:.0f} "
        f"| {r['p50_ms'] - direct['p50_ms']:+.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--router-bin", type=Path, default=ROUTER_BIN, help="vllm-router binary")
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--no-redis", action="store_true", help="leave the Redis gateway out")
    parser.add_argument(
        "--servers", action="store_true", help="also the gateway app under uvicorn and granian"
    )
    parser.add_argument(
        "--workers", type=int, default=0,
        help="also the gateway as N worker processes on one port, their table in Redis",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="Markdown results file")
    args = parser.parse_args()
    counts = dict(
        zip(LEVELS, (300, 1500, 3000) if args.quick else (3000, 15000, 30000), strict=True)
    )
    rounds = 3
    with_router = not args.no_router and args.router_bin.exists()
    if not args.no_router and not with_router:
        print(f"no vllm-router at {args.router_bin}: its columns are left out", file=sys.stderr)

    py = sys.executable
    fake = (py, str(ROOT / "benchmarks" / "fast_upstream.py"), "--port", str(FAKE_PORT))
    fake_url = f"http://127.0.0.1:{FAKE_PORT}"
    gateway = (py, "-m", "kvturn.gateway.ops.cli", "serve", "--prefill", fake_url,
               "--decode", fake_url, "--decode-control", fake_url,
               "--port", str(GATEWAY_PORT))  # fmt: skip
    untracked = (*gateway[:-1], str(UNTRACKED_PORT), "--implicit-conversations", "off")
    redis_bin = shutil.which("redis-server")
    with_redis = not args.no_redis and redis_bin is not None
    redis = (str(redis_bin), "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no")  # fmt: skip
    gateway_redis = (*gateway[:-1], str(GATEWAY_REDIS_PORT),
                     "--state", f"redis://127.0.0.1:{REDIS_PORT}/0")  # fmt: skip
    asgi_env = {
        "KVTURN_PREFILL_URLS": fake_url,
        "KVTURN_DECODE_URLS": fake_url,
        "KVTURN_DECODE_CONTROL_URLS": fake_url,
    }
    asgi_servers = _asgi_servers(py) if args.servers else {}
    workers: dict[str, tuple[str, ...]] = {}
    if args.workers > 1 and with_redis:
        workers[WORKERS_KIND] = (*gateway[:-1], str(WORKERS_PORT), "--workers", str(args.workers),
                                 "--state", f"redis://127.0.0.1:{REDIS_PORT}/1")  # fmt: skip
    router = (str(args.router_bin), "--vllm-pd-disaggregation",
              "--prefill", f"http://localhost:{FAKE_PORT}", "--decode", fake_url,
              "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
              "--prometheus-port", str(ROUTER_METRICS_PORT), "--log-level", "warning")  # fmt: skip

    kinds = [
        "direct",
        "gateway",
        UNTRACKED_KIND,
        *(["gateway-redis"] if with_redis else []),
        *(["router"] if with_router else []),
        *asgi_servers,
        *workers,
    ]
    with_cid = ["gateway+cid", *(["gateway-redis+cid"] if with_redis else [])]
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]] = {}
    started = time.monotonic()
    with (
        server(*fake, port=FAKE_PORT),
        server(*gateway, port=GATEWAY_PORT) as gateway_proc,
        server(*untracked, port=UNTRACKED_PORT) as untracked_proc,
        server(*redis, port=REDIS_PORT, http=False) if with_redis else _nothing() as redis_proc,
        server(*gateway_redis, port=GATEWAY_REDIS_PORT) if with_redis else _nothing() as g_redis,
        server(*router, port=ROUTER_PORT) if with_router else _nothing() as router_proc,
        contextlib.ExitStack() as stack,
    ):
        # Whose CPU each kind's requests cost: its server processes (a Redis gateway's
        # redis-server too).
        pids = {"gateway": [gateway_proc.pid], UNTRACKED_KIND: [untracked_proc.pid]}
        redis_pids = [redis_proc.pid] if redis_proc is not None else []
        if g_redis is not None:
            pids["gateway-redis"] = [g_redis.pid, *redis_pids]
        if router_proc is not None:
            pids["router"] = [router_proc.pid]
        for kind, command in asgi_servers.items():
            proc = stack.enter_context(server(*command, port=SERVER_PORTS[kind], env=asgi_env))
            pids[kind] = [proc.pid]
        for kind, command in workers.items():
            proc = stack.enter_context(server(*command, port=PORTS[kind]))
            pids[kind] = [proc.pid, *redis_pids]
        for stream in (False, True):
            if with_router:
                check_router_does_pd(stream)
            for concurrency in LEVELS:
                n = counts[concurrency]
                if concurrency == 1:
                    found = uvloop.run(sequential([*kinds, *with_cid], stream, n))
                else:
                    found = uvloop.run(concurrent(kinds, stream, concurrency, n, rounds, pids))
                results[(stream, concurrency)] = found
                print(f"stream={stream} c={concurrency}: {found}", flush=True)
        paced: dict[bool, dict[str, dict[str, Any]]] = {}
        if with_redis:
            for stream in (False, True):
                compared = ["direct", "gateway", "gateway-redis", *with_cid]
                paced[stream] = uvloop.run(
                    sequential(compared, stream, counts[1] // 3, PACED_GAP_S)
                )
                print(f"stream={stream} c=1 paced: {paced[stream]}", flush=True)
    took = time.monotonic() - started
    servers = {"fake": fake, "gateway": gateway, "router": router, "redis": gateway_redis}
    write_results(args, results, counts, rounds, took, servers, with_router, with_redis)
    write_untracked_results(args.out, results, untracked, with_router)
    if asgi_servers:
        write_server_results(args.out, results, asgi_servers)
    if workers:
        write_worker_results(args.out, results, workers, args.workers)
    write_cpu_results(args.out, results)
    if paced:
        write_paced_results(args.out, results, paced, counts[1] // 3)
    return 0


def _asgi_servers(py: str) -> dict[str, tuple[str, ...]]:
    """Commands serving the gateway app whole (one worker each, uvloop)."""
    uvicorn = (py, "-m", "uvicorn", "--factory", "--app-dir", "benchmarks", "asgi_gateway:app",
               "--loop", "uvloop", "--log-level", "warning", "--no-access-log")  # fmt: skip
    commands: dict[str, tuple[str, ...]] = {
        "uvicorn-httptools": (*uvicorn, "--http", "httptools",
                              "--port", str(SERVER_PORTS["uvicorn-httptools"])),
        "uvicorn-h11": (*uvicorn, "--http", "h11", "--port", str(SERVER_PORTS["uvicorn-h11"])),
    }  # fmt: skip
    granian = Path(py).parent / "granian"
    if granian.exists():
        commands["granian"] = (
            str(granian), "--interface", "asgi", "--factory", "--loop", "uvloop",
            "--workers", "1", "--no-ws", "--log-level", "warning", "--no-access-log",
            "--host", "127.0.0.1", "--port", str(SERVER_PORTS["granian"]),
            "benchmarks.asgi_gateway:app",
        )  # fmt: skip
    return commands


def write_untracked_results(
    out: Path,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    untracked: tuple[str, ...],
    with_router: bool,
) -> None:
    """The gateway with and without implicit conversations, beside vllm-router."""
    intro = [
        "## What tracking id-less conversations costs (same run)",
        "",
        "The requests above carry no conversation id. By default the gateway still tracks "
        "each as a conversation (implicit conversations: its messages are digested, it gets "
        "an entry in the table, decode is asked to keep its KV, and where that KV stays is "
        "recorded after the reply), so that the next turn of it can reuse that KV. vllm-router "
        "tracks nothing. `gateway-untracked` is the same gateway with implicit conversations "
        f"off, relaying such a request P/D as vllm-router does: `{shown(untracked)}`.",
    ]
    kinds = ["gateway", UNTRACKED_KIND, *(["router"] if with_router else [])]
    _append_added_table(out, results, intro, kinds)


def write_server_results(
    out: Path,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    asgi_servers: dict[str, tuple[str, ...]],
) -> None:
    """The gateway app under each HTTP server: added p50 and req/s, beside the gateway's own."""
    intro = [
        "## The gateway app under maintained ASGI servers (same run)",
        "",
        "The same app (`kvturn.gateway.app.create_app`), one process each on uvloop: the "
        "gateway's own HTTP server (`kvturn serve`), and the app served whole by:",
        "",
        *(f"- {kind}: `{shown(command)}`" for kind, command in asgi_servers.items()),
    ]
    _append_added_table(out, results, intro, ["gateway", *asgi_servers])


def write_worker_results(
    out: Path,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    workers: dict[str, tuple[str, ...]],
    n: int,
) -> None:
    """The gateway as several processes (one Redis table) beside one process and vllm-router."""
    intro = [
        f"## The gateway as {n} worker processes (same run)",
        "",
        f"`kvturn serve --workers {n}`, the conversation table shared in the same Redis "
        f"(another database): `{shown(workers[WORKERS_KIND])}`. Beside it, one gateway process "
        "(table in process, and in Redis) and vllm-router, from the rows above.",
    ]
    measured = results[(False, 1)]
    kinds = [k for k in ("gateway", "gateway-redis", WORKERS_KIND, "router") if k in measured]
    _append_added_table(out, results, intro, kinds)


def write_paced_results(
    out: Path,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    paced: dict[bool, dict[str, dict[str, Any]]],
    n: int,
) -> None:
    """Redis against in process at concurrency 1: back to back (the rows above) and paced."""
    lines = [
        "",
        "## What Redis costs a turn at concurrency 1, back to back and paced (same run)",
        "",
        "Added p50 of the gateway with its table in Redis and of the gateway with it in "
        "process, and the difference, for requests with and without `X-Conversation-Id`. Back "
        "to back: the concurrency-1 rows above, each request sent as the previous one (of "
        "whichever kind) ends. Paced: the same kinds once more, "
        f"{n} requests each, interleaved the same way, the load generator idle "
        f"{PACED_GAP_S * 1000:.0f} ms after each request. Back to back, the work a request "
        "leaves running after its reply (a Redis gateway's record: its Redis client and "
        "redis-server) competes with the next request for the two cores, shared by four busy "
        "processes; paced, most of it is done before the next request starts. Either way a "
        "turn with an id waits for its take before prefill: one round trip to Redis.",
        "",
        "| streamed | id | back to back: in process | Redis | Redis minus in process "
        "| paced: in process | Redis | Redis minus in process |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stream, found in paced.items():
        back = results[(stream, 1)]
        for cid in ("", "+cid"):
            inproc, redis = "gateway" + cid, "gateway-redis" + cid
            if redis not in found:
                continue
            cells = []
            for run in (back, found):
                a = run[inproc]["p50_ms"] - run["direct"]["p50_ms"]
                b = run[redis]["p50_ms"] - run["direct"]["p50_ms"]
                cells.append(f"{a:+.3f} | {b:+.3f} | {b - a:+.3f}")
            lines.append(
                f"| {'yes' if stream else 'no'} | {'yes' if cid else 'no'} | {' | '.join(cells)} |"
            )
    with out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_cpu_results(
    out: Path, results: dict[tuple[bool, int], dict[str, dict[str, Any]]]
) -> None:
    """What each router's requests cost in CPU at concurrency 32 and 256 (same rounds)."""
    lines = [
        "",
        "## CPU per request (same run)",
        "",
        "CPU time (user and system, all threads and child processes) of each router's own "
        "processes during its measured rounds: per request, and as cores busy (CPU seconds "
        "over wall seconds). The Redis kinds include their redis-server. Two cores are shared "
        "with the fake engine and the load generator: a process with one thread of Python "
        "is capped at one core, a multi-threaded one is not.",
        "",
        "| streamed | concurrency | router | req/s | CPU per request | cores busy |",
        "|---|---|---|---|---|---|",
    ]
    for (stream, c), found in results.items():
        for kind, r in found.items():
            if "cpu_us" in r:
                lines.append(
                    f"| {'yes' if stream else 'no'} | {c} | {kind} | {r['rps']:.0f} "
                    f"| {r['cpu_us']:.0f} µs | {r['cores']:.2f} |"
                )
    with out.open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _append_added_table(
    out: Path,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    intro: list[str],
    kinds: list[str],
) -> None:
    """A section of the results: ``intro``, then each kind's added p50 and req/s per row."""
    lines = [
        "",
        *intro,
        "",
        "| streamed | concurrency | "
        + " | ".join(f"{k} added p50 | {k} req/s" for k in kinds)
        + " |",
        "|---|---|" + "---|---|" * len(kinds),
    ]
    for (stream, c), found in results.items():
        d = found["direct"]
        cells = " | ".join(
            f"{found[k]['p50_ms'] - d['p50_ms']:+.3f} | {found[k]['rps']:.0f}" for k in kinds
        )
        lines.append(f"| {'yes' if stream else 'no'} | {c} | {cells} |")
    with out.open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_results(
    args: argparse.Namespace,
    results: dict[tuple[bool, int], dict[str, dict[str, Any]]],
    counts: dict[int, int],
    rounds: int,
    took: float,
    servers: dict[str, tuple[str, ...]],
    with_router: bool,
    with_redis: bool,
) -> None:
    fake, gateway, router = servers["fake"], servers["gateway"], servers["router"]
    quick = (
        (" --quick" if args.quick else "")
        + (" --servers" if args.servers else "")
        + (f" --workers {args.workers}" if args.workers > 1 else "")
    )
    lines = [
        "# Router overhead against a fast fake upstream (P/D mode)"
        + (" — QUICK smoke run: few requests, noisy" if args.quick else ""),
        "",
        f"Command: `.venv/bin/python benchmarks/gateway_overhead.py{quick}` ({took:.0f} s)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores shared by the fake "
        "engine, the routers and the load generator (one process: kvturn's HTTP/1.1 client, "
        "`kvturn.gateway.http.client`, on uvloop; at high concurrency it is part of what is "
        "measured).  ",
        f"Requests per kind: c=1: {counts[1]}, interleaved request by request across the kinds "
        "(a slow moment of the machine lands on all alike), req/s = 1 / mean latency; "
        + ", ".join(f"c={c}: {counts[c]}" for c in LEVELS if c > 1)
        + f" in {rounds} rounds alternating the kinds, req/s = the median round's, latencies "
        "pooled. Each kind is warmed up first.  ",
        "'direct' = the load generator itself does prefill then decode against the fake; "
        "'added' = that router's p50 minus direct p50 (what the router costs on top of the two "
        "hops it replaces). Latencies in ms. At concurrency 32 and 256 the two cores are "
        "saturated, so latency there is mostly queueing and req/s is the figure to compare.",
        "",
        "Servers:",
        "",
        f"- fake engine (prefill and decode, canned answers): `{shown(fake)}`",
        f"- kvturn gateway: `{shown(gateway)}`",
        f"- kvturn gateway, state in Redis ({_redis_version()}, loopback, no persistence): "
        f"`{shown(servers['redis'])}`"
        if with_redis
        else "- kvturn gateway with Redis state: not measured",
        f"- vllm-router {router_version(args.router_bin)}: `{shown(router)}`"
        if with_router
        else "- vllm-router: not measured",
        "",
        "| streamed | concurrency | direct p50 | direct p99 | direct req/s "
        "| gateway p50 | gateway p99 | gateway req/s | gateway added p50 "
        "| gateway+Redis p50 | gateway+Redis p99 | gateway+Redis req/s | gateway+Redis added p50 "
        "| vllm-router p50 | vllm-router p99 | vllm-router req/s | vllm-router added p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    absent = "— | — | — | —"
    for (stream, c), found in results.items():
        d = found["direct"]
        router_cells = _cells(found["router"], d) if with_router else absent
        redis_cells = _cells(found["gateway-redis"], d) if with_redis else absent
        lines.append(
            f"| {'yes' if stream else 'no'} | {c} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} "
            f"| {d['rps']:.0f} | {_cells(found['gateway'], d)} | {redis_cells} | {router_cells} |"
        )
    lines += [
        "",
        "Gateway with `X-Conversation-Id` (64 rotating ids; the conversation-aware path: table "
        "lookups, settling the KV location after each reply, which vllm-router has no "
        "counterpart for), concurrency 1, interleaved with the rows above; the table in "
        "process and in Redis (without an id the gateway's implicit-conversation path uses "
        "the table too: the rows above):",
        "",
        "| streamed | state | direct p50 | gateway p50 | gateway p99 | gateway req/s | added p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for (stream, c), found in results.items():
        if c != 1:
            continue
        d = found["direct"]
        for kind, state in (("gateway+cid", "in process"), ("gateway-redis+cid", "Redis")):
            if kind not in found:
                continue
            g = found[kind]
            lines.append(
                f"| {'yes' if stream else 'no'} | {state} | {d['p50_ms']:.3f} "
                f"| {g['p50_ms']:.3f} | {g['p99_ms']:.3f} | {g['rps']:.0f} "
                f"| {g['p50_ms'] - d['p50_ms']:+.3f} |"
            )
    if with_router:
        lines += ["", ROUTER_NOTES.rstrip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _redis_version() -> str:
    try:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    except OSError:
        return "redis-server"
    return " ".join(out.stdout.split()[:3])


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    raise SystemExit(main())
