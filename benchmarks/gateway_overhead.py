"""Latency the gateway adds, and its peak request rate, against a fast fake upstream; the Rust
vllm-router (PyPI ``vllm-router``, P/D mode) measured the same way for comparison.

    .venv/bin/python benchmarks/gateway_overhead.py [--quick]

A fake engine (tests/fake_engine.py: answers instantly, prefill and decode roles) runs in one
process, the gateway (``kvturn serve``) in another, vllm-router in a third, the load generator
(aiohttp + uvloop) here. "direct" is the same P/D exchange done by the client itself (prefill,
then decode with the returned params), so "added" is what a router costs on top of the two hops
it replaces. vllm-router lives in its own virtualenv so it cannot disturb kvturn's packages:

    python3 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17

(without it, or with --no-router, its columns are left out). Results:
benchmarks/results/gateway_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import uvloop

from kvturn.kv_params import PREFILL_FOR_REMOTE_DECODE

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gateway_overhead.md"
ROUTER_BIN = ROOT / ".venv-router" / "bin" / "vllm-router"
GATEWAY_PORT, FAKE_PORT, ROUTER_PORT, ROUTER_METRICS_PORT = 29000, 29001, 29002, 29003
LEVELS = (1, 32, 256)
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 2}
PREFILL = PREFILL_FOR_REMOTE_DECODE
PORTS = {"gateway": GATEWAY_PORT, "router": ROUTER_PORT}

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
round robin is the cheapest. Each vllm-router measurement checks the fake's `/fake/counts`:
exactly one prefill and one decode per request.
"""


def _shown(command: tuple[str, ...]) -> str:
    return shlex.join(os.path.relpath(part, ROOT) if part.startswith(str(ROOT)) else part
                      for part in command)  # fmt: skip


@contextmanager
def server(*command: str, port: int) -> Iterator[None]:
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{_shown(command)} did not come up on :{port}\n{tail}")
                time.sleep(0.1)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def one_direct(session: aiohttp.ClientSession, stream: bool) -> float:
    base = f"http://127.0.0.1:{FAKE_PORT}/v1/chat/completions"
    started = time.perf_counter()
    prefill = {**BODY, "max_tokens": 1, "kv_transfer_params": PREFILL}
    async with session.post(base, data=orjson.dumps(prefill)) as r:
        params = orjson.loads(await r.read())["kv_transfer_params"]
    decode = {**BODY, "stream": stream, "kv_transfer_params": params}
    async with session.post(base, data=orjson.dumps(decode)) as r:
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - started


async def one_routed(
    session: aiohttp.ClientSession, port: int, stream: bool, cid: str | None
) -> float:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if cid:
        headers["X-Conversation-Id"] = cid
    started = time.perf_counter()
    async with session.post(
        url, data=orjson.dumps({**BODY, "stream": stream}), headers=headers
    ) as r:
        assert r.status == 200, await r.read()
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - started


async def measure(
    kind: str, stream: bool, concurrency: int, requests: int, cid: bool = False
) -> dict[str, Any]:
    """``requests`` calls from ``concurrency`` workers, after a warm-up at the same concurrency
    (opens the connection pools of the client and of the router under test)."""
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def call(i: int) -> float:
            if kind == "direct":
                return await one_direct(session, stream)
            return await one_routed(
                session, PORTS[kind], stream, f"bench-{i % 64}" if cid else None
            )

        async def run(n: int) -> tuple[list[float], float]:
            latencies: list[float] = []
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:
                    latencies.append(await call(i))

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies, time.perf_counter() - started

        warm = min(requests, max(200, 2 * concurrency))
        await run(warm)
        latencies, elapsed = await run(requests)
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[max(0, math.ceil(len(latencies) * 0.99) - 1)] * 1000,
        "rps": len(latencies) / elapsed,
        "calls": warm + requests,
    }


def fake_counts() -> dict[str, int]:
    return httpx.get(f"http://127.0.0.1:{FAKE_PORT}/fake/counts", timeout=5).json()


def measure_router(stream: bool, concurrency: int, requests: int) -> dict[str, Any]:
    """Measures vllm-router and checks it did P/D: one prefill and one decode per request."""
    before = fake_counts()
    result = uvloop.run(measure("router", stream, concurrency, requests))
    after = fake_counts()
    seen = {role: after[role] - before[role] for role in ("prefill", "decode")}
    if seen != {"prefill": result["calls"], "decode": result["calls"]}:
        raise RuntimeError(
            f"vllm-router did not do P/D: {result['calls']} requests, fake saw {seen}"
        )
    return result


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
    parser.add_argument("--out", type=Path, default=RESULTS, help="Markdown results file")
    args = parser.parse_args()
    counts = dict(
        zip(LEVELS, (200, 1000, 2000) if args.quick else (2000, 10000, 20000), strict=True)
    )
    with_router = not args.no_router and args.router_bin.exists()
    if not args.no_router and not with_router:
        print(f"no vllm-router at {args.router_bin}: its columns are left out", file=sys.stderr)

    py = sys.executable
    fake = (py, "-m", "uvicorn", "tests.fake_engine:app", "--port", str(FAKE_PORT),
            "--loop", "uvloop", "--http", "httptools", "--log-level", "warning",
            "--no-access-log")  # fmt: skip
    fake_url = f"http://127.0.0.1:{FAKE_PORT}"
    gateway = (py, "-m", "kvturn.gateway.cli", "serve", "--prefill", fake_url, "--decode", fake_url,
               "--decode-control", fake_url, "--port", str(GATEWAY_PORT))  # fmt: skip
    router = (str(args.router_bin), "--vllm-pd-disaggregation",
              "--prefill", f"http://localhost:{FAKE_PORT}", "--decode", fake_url,
              "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
              "--prometheus-port", str(ROUTER_METRICS_PORT), "--log-level", "warning")  # fmt: skip

    rows: list[tuple[bool, int, dict[str, Any], dict[str, Any], dict[str, Any] | None]] = []
    cid_rows: list[tuple[bool, dict[str, Any], dict[str, Any]]] = []
    started = time.monotonic()
    with (
        server(*fake, port=FAKE_PORT),
        server(*gateway, port=GATEWAY_PORT),
        server(*router, port=ROUTER_PORT) if with_router else _nothing(),
    ):
        for stream in (False, True):
            for concurrency in LEVELS:
                n = counts[concurrency]
                direct = uvloop.run(measure("direct", stream, concurrency, n))
                via = uvloop.run(measure("gateway", stream, concurrency, n))
                routed = measure_router(stream, concurrency, n) if with_router else None
                rows.append((stream, concurrency, direct, via, routed))
                print(f"stream={stream} c={concurrency}: direct {direct}, gateway {via}, "
                      f"vllm-router {routed}", flush=True)  # fmt: skip
            direct = next(r[2] for r in rows if r[0] == stream and r[1] == 1)
            via = uvloop.run(measure("gateway", stream, 1, counts[1], cid=True))
            cid_rows.append((stream, direct, via))
            print(f"stream={stream} c=1 conversation id: gateway {via}", flush=True)
    took = time.monotonic() - started

    quick = " --quick" if args.quick else ""
    lines = [
        "# Router overhead against a fast fake upstream (P/D mode)"
        + (" — QUICK smoke run: few requests, noisy" if args.quick else ""),
        "",
        f"Command: `.venv/bin/python benchmarks/gateway_overhead.py{quick}` ({took:.0f} s)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores shared by the fake "
        "engine, the routers and the load generator (aiohttp + uvloop; one process, so at high "
        "concurrency it is part of what is measured). Requests per level (after a warm-up at the "
        f"same concurrency): {', '.join(f'c={c}: {n}' for c, n in counts.items())}.  ",
        "'direct' = the client itself does prefill then decode against the fake; 'added' = that "
        "router's p50 minus direct p50. Latencies in ms. At concurrency 32 and 256 the cores "
        "are saturated (direct req/s is about the fake engine's own limit), so latency there is "
        "mostly queueing and req/s is the figure to compare.",
        "",
        "Servers:",
        "",
        f"- fake engine (prefill and decode): `{_shown(fake)}`",
        f"- kvturn gateway: `{_shown(gateway)}`",
        f"- vllm-router {router_version(args.router_bin)}: `{_shown(router)}`"
        if with_router
        else "- vllm-router: not measured",
        "",
        "| streamed | concurrency | direct p50 | direct p99 | direct req/s "
        "| gateway p50 | gateway p99 | gateway req/s | gateway added p50 "
        "| vllm-router p50 | vllm-router p99 | vllm-router req/s | vllm-router added p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stream, c, d, g, r in rows:
        router_cells = _cells(r, d) if r else "— | — | — | —"
        lines.append(
            f"| {'yes' if stream else 'no'} | {c} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} "
            f"| {d['rps']:.0f} | {_cells(g, d)} | {router_cells} |"
        )
    lines += [
        "",
        "Gateway with `X-Conversation-Id` (64 rotating ids; the conversation-aware path, which "
        "vllm-router has no counterpart for), concurrency 1, against the direct row above:",
        "",
        "| streamed | direct p50 | gateway p50 | gateway p99 | gateway req/s | added p50 |",
        "|---|---|---|---|---|---|",
    ]
    for stream, d, g in cid_rows:
        lines.append(
            f"| {'yes' if stream else 'no'} | {d['p50_ms']:.3f} | {g['p50_ms']:.3f} "
            f"| {g['p99_ms']:.3f} | {g['rps']:.0f} | {g['p50_ms'] - d['p50_ms']:+.3f} |"
        )
    if with_router:
        lines += ["", ROUTER_NOTES.rstrip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    raise SystemExit(main())
