"""Latency the gateway adds, and its peak request rate, against a fast fake upstream.

    .venv/bin/python benchmarks/gateway_overhead.py [--quick]

A fake engine (tests/fake_engine.py: answers instantly, prefill and decode roles) runs in one
process, the gateway (``kvturn serve``) in another, the load generator (aiohttp + uvloop) here.
"direct" is the same P/D exchange done by the client itself (prefill, then decode with the
returned params), so "added" is what the gateway costs on top of the two hops it replaces.
Results: benchmarks/results/gateway_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gateway_overhead.md"
FAKE_PORT, GATEWAY_PORT = 29001, 29000
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 2}
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@contextmanager
def server(*command: str, port: int):  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


async def one_direct(session: aiohttp.ClientSession, stream: bool) -> float:
    base = f"http://127.0.0.1:{FAKE_PORT}/v1/chat/completions"
    started = time.perf_counter()
    async with session.post(base, data=orjson.dumps({**BODY, "max_tokens": 1, "kv_transfer_params": PREFILL})) as r:
        params = orjson.loads(await r.read())["kv_transfer_params"]
    async with session.post(base, data=orjson.dumps({**BODY, "stream": stream, "kv_transfer_params": params})) as r:
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - started


async def one_gateway(session: aiohttp.ClientSession, stream: bool, cid: str | None) -> float:
    url = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if cid:
        headers["X-Conversation-Id"] = cid
    started = time.perf_counter()
    async with session.post(url, data=orjson.dumps({**BODY, "stream": stream}), headers=headers) as r:
        assert r.status == 200, await r.read()
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - started


async def measure(kind: str, stream: bool, concurrency: int, requests: int, cid: bool) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:
        async def call(i: int) -> float:
            if kind == "direct":
                return await one_direct(session, stream)
            return await one_gateway(session, stream, f"bench-{i % 64}" if cid else None)

        for i in range(min(200, requests)):  # warm connections and code paths
            await call(i)
        latencies: list[float] = []
        counter = iter(range(requests))

        async def worker() -> None:
            for i in counter:
                latencies.append(await call(i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "rps": len(latencies) / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = parser.parse_args()
    n1, n32 = (300, 2000) if args.quick else (2000, 10000)
    py = sys.executable
    fake = (py, "-m", "uvicorn", "tests.fake_engine:app", "--port", str(FAKE_PORT), "--loop",
            "uvloop", "--http", "httptools", "--log-level", "warning", "--no-access-log")  # fmt: skip
    fake_url = f"http://127.0.0.1:{FAKE_PORT}"
    gateway = (py, "-m", "kvturn.gateway.cli", "serve", "--prefill", fake_url, "--decode", fake_url,
               "--decode-control", fake_url, "--port", str(GATEWAY_PORT))  # fmt: skip
    rows = []
    with server(*fake, port=FAKE_PORT), server(*gateway, port=GATEWAY_PORT):
        for stream in (False, True):
            for concurrency, n in ((1, n1), (32, n32)):
                direct = uvloop.run(measure("direct", stream, concurrency, n, False))
                via = uvloop.run(measure("gateway", stream, concurrency, n, False))
                rows.append((stream, concurrency, "no", direct, via))
                print(rows[-1], flush=True)
            direct = uvloop.run(measure("direct", stream, 1, n1, False))
            via = uvloop.run(measure("gateway", stream, 1, n1, True))
            rows.append((stream, 1, "yes", direct, via))
            print(rows[-1], flush=True)
    lines = [
        "# Gateway overhead against a fast fake upstream (P/D mode)",
        "",
        f"Command: `.venv/bin/python benchmarks/gateway_overhead.py{' --quick' if args.quick else ''}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; 2 CPU cores shared by the fake engine, the "
        "gateway and the load generator (aiohttp + uvloop). 'direct' = the client itself does "
        "prefill then decode against the fake; 'added' = gateway p50 minus direct p50.",
        "",
        "| streamed | concurrency | conversation id | direct p50 | gateway p50 | added p50 | gateway p99 | direct req/s | gateway req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stream, c, cid, d, g in rows:
        lines.append(
            f"| {'yes' if stream else 'no'} | {c} | {cid} | {d['p50_ms']:.3f} ms | {g['p50_ms']:.3f} ms "
            f"| {g['p50_ms'] - d['p50_ms']:.3f} ms | {g['p99_ms']:.3f} ms | {d['rps']:.0f} | {g['rps']:.0f} |"
        )
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
