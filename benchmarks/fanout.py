"""Subagent fan-out: kvturn beside "vLLM P/D as deployed", on the same engines, in one run.

Set-up (vllm-router pins its own dependencies: a venv of its own):

    python3.11 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17

Run:

    .venv/bin/python benchmarks/fanout.py                      # every workload, 3 repeats
    .venv/bin/python benchmarks/fanout.py --workloads roomy --repeats 1

AIPerf's synthetic multi-turn workload has no forks, so this is the project's own trace, driven
by an async client (httpx) that streams every turn and times its first content token. Each
*parent* agent opens with a shared system prompt and a long task, and runs ``parent_turns``
turns (a tool result and a short reply each); after its turn ``fork_after`` it starts
``subagents`` subagents at once, each from the parent's context as it stood then (its
messages and its reply) plus a task of its own, under a session id of its own, or none for
one of them; each subagent runs ``subagent_turns`` turns while the parent goes on. ``parents``
parents run at once, ``think_s`` apart between turns.

The modes, interleaved (the order alternates from one repeat to the next), on the engines one
``kvturn up`` started (prefill with vLLM's prefix cache on; decode keeping nothing of a request
no kvturn gateway sent):

``vllm-pd``
    What a vLLM user runs today: vllm-router 0.1.17 in P/D mode, ``consistent_hash`` on
    ``X-Session-ID`` (a subagent's session id is its own, as a framework gives it). A
    subagent's first prompt finds its parent's context in prefill's prefix cache if the cache
    still holds it.
``kvturn``
    The gateway, the same requests with the same headers.

Every run draws its own prompts (its own seed), so no run finds another's in any cache. Per
run: TTFT p50/p90 of every turn and of subagents' first turns, the whole run's duration (job),
and prompt tokens each engine computed, served from its own prefix cache, or received over
NIXL. ``--answers`` runs both modes once more on one seed, each under a cache salt of its own,
and compares every reply.

Results: ``benchmarks/results/fanout.md`` (and ``fanout.json``, every run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _pair import (
    ROUTER_PORT,
    SESSION_HEADER,
    as_deployed,
    engine_counters,
    gateway_plans,
    interleaved,
    wait_idle,
)

RESULTS = Path(__file__).parent / "results"
GATEWAY_PORT = 28000
MODES = ("vllm-pd", "kvturn")
MAX_TOKENS = 24


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    parents: int = 4
    parent_turns: int = 5
    fork_after: int = 3
    subagents: int = 3
    subagent_turns: int = 2
    think_s: float = 0.5
    system_tokens: int = 1000
    task_tokens: int = 1500
    tool_tokens: int = 300
    prefill_blocks: int | None = None
    decode_blocks: int | None = None
    #: Prefill engines (1 or 2: this machine runs three engines at most).
    prefills: int = 1
    #: Seconds between one parent's start and the next's (0: all at once).
    stagger_s: float = 0.0


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "roomy",
            "memory to spare (2 GiB of KV per engine): 4 parents at once, each forking 3 "
            "subagents after its third turn",
        ),
        Workload(
            "pressure",
            "prefill's cache smaller than the working set: 96 prefill blocks (12k tokens) "
            "against 4 parents' and 12 subagents' contexts (~3.5-4.5k tokens each); decode "
            "400 blocks",
            prefill_blocks=96,
            decode_blocks=400,
        ),
        Workload(
            "shared-prompt",
            "2 prefills + 1 decode; 8 conversations of 2 turns that share a 4k-token system "
            "prompt and nothing else, started one after another (1 s apart): each prefill "
            "should compute the shared prompt once",
            parents=8,
            parent_turns=2,
            subagents=0,
            system_tokens=4000,
            task_tokens=300,
            prefills=2,
            stagger_s=1.0,
        ),
        Workload(
            "smoke",
            "a check that every part runs (not a measurement)",
            parents=1,
            parent_turns=2,
            fork_after=1,
            subagents=2,
            subagent_turns=1,
        ),
    )
}
DEFAULT_WORKLOADS = ("roomy", "pressure", "shared-prompt")


@dataclass
class TurnTime:
    agent: str
    turn: int
    subagent: bool
    ttft_s: float
    plan: str | None
    reason: str | None
    text: str


def _text(rng: random.Random, tokens: int, topic: str) -> str:
    """About ``tokens`` tokens for the tiny model (byte-level: a character each)."""
    words = ["harbour", "ledger", "gauge", "tide", "cargo", "signal", "crane", "berth", "manifest"]
    out = f"{topic}: "
    while len(out) < tokens:
        out += rng.choice(words) + " "
    return out[:tokens]


async def _turn(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    messages: list[dict[str, Any]],
    session: str | None,
    salt: str | None,
) -> tuple[float, str, httpx.Headers]:
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    headers = {SESSION_HEADER: session} if session else {}
    started = time.perf_counter()
    first: float | None = None
    text = ""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    first = first or time.perf_counter()
                    text += piece
        seen = response.headers
    return (first or time.perf_counter()) - started, text, seen


async def replay(
    workload: Workload, url: str, model: str, seed: int, salt: str | None = None
) -> tuple[list[TurnTime], float]:
    """Every parent and its subagents through ``url``; (turn times, seconds for all)."""
    rng = random.Random(seed)
    system = {"role": "system", "content": _text(rng, workload.system_tokens, f"system {seed}")}
    times: list[TurnTime] = []
    endpoint = url + "/v1/chat/completions"

    async def agent(
        client: httpx.AsyncClient, name: str, messages: list[dict[str, Any]], turns: int,
        session: str | None, subagent: bool, forks: int | None,
    ) -> None:  # fmt: skip
        local = random.Random(f"{seed}-{name}")
        spawned: list[asyncio.Task[None]] = []
        for turn in range(turns):
            ttft, text, headers = await _turn(client, endpoint, model, messages, session, salt)
            times.append(TurnTime(name, turn, subagent, ttft,
                                  headers.get("x-kvturn-plan"),
                                  headers.get("x-kvturn-plan-reason"), text))  # fmt: skip
            messages = [*messages, {"role": "assistant", "content": text}]
            if forks and turn + 1 == workload.fork_after:
                for k in range(forks):
                    task = {"role": "user", "content": _text(local, 200, f"subagent {k} task")}
                    sub = f"{name}-sub{k}"
                    # One subagent sends no session id (a framework that sets none).
                    sub_session = None if k == forks - 1 else f"{sub}-{uuid.uuid4().hex[:6]}"
                    spawned.append(asyncio.create_task(agent(
                        client, sub, [*messages, task], workload.subagent_turns, sub_session,
                        True, None,
                    )))  # fmt: skip
            tool = {"role": "tool", "content": _text(local, workload.tool_tokens, f"tool {turn}")}
            messages = [*messages, tool]
            await asyncio.sleep(workload.think_s)
        await asyncio.gather(*spawned)

    async def parent(client: httpx.AsyncClient, p: int) -> None:
        await asyncio.sleep(p * workload.stagger_s)
        task = {"role": "user", "content": _text(rng, workload.task_tokens, f"parent {p} {seed}")}
        session = f"p{p}-{seed}-{uuid.uuid4().hex[:6]}"
        await agent(client, f"p{p}", [system, task], workload.parent_turns, session, False,
                    workload.subagents)  # fmt: skip

    started = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(parent(client, p) for p in range(workload.parents)))
    return times, time.monotonic() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(times: list[TurnTime], job_s: float) -> dict[str, Any]:
    firsts = [t.ttft_s for t in times if t.subagent and t.turn == 0]
    every = [t.ttft_s for t in times]
    return {
        "ttft_p50": pct(every, 0.5), "ttft_p90": pct(every, 0.9),
        "fork_ttft_p50": pct(firsts, 0.5), "fork_ttft_p90": pct(firsts, 0.9),
        "job_s": job_s, "turns": len(times),
        "fork_plans": sorted({f"{t.plan}/{t.reason}" for t in times if t.subagent and t.turn == 0
                              and t.plan}),
    }  # fmt: skip


def run_workload(workload: Workload, repeats: int, seed: int, answers: bool) -> dict[str, Any]:
    up_args = [
        "--prefill", str(workload.prefills),
        *(["--prefill-kv-blocks", str(workload.prefill_blocks)] if workload.prefill_blocks else []),
    ]  # fmt: skip
    runs: list[dict[str, Any]] = []
    checked: dict[str, Any] | None = None
    print(f"== {workload.name}: starting engines", flush=True)
    with as_deployed(
        gateway_port=GATEWAY_PORT,
        kv_cache_gb=2,
        decode_kv_blocks=workload.decode_blocks,
        extra_args=tuple(up_args),
    ) as (state, router_command):
        engines = state["prefill"] + state["decode"]
        gateway = str(state["gateway"]).removesuffix("/v1")
        urls = {"vllm-pd": f"http://127.0.0.1:{ROUTER_PORT}", "kvturn": gateway}
        model = str(state["model"])
        for repeat, mode in interleaved(MODES, repeats):
            run_seed = seed + 100 * repeat + MODES.index(mode)
            wait_idle(engines)
            before, plans_before = engine_counters(engines), gateway_plans(gateway)
            each_before = {url: engine_counters([url]) for url in state["prefill"]}
            times, job_s = asyncio.run(replay(workload, urls[mode], model, run_seed))
            wait_idle(engines)
            after, plans_after = engine_counters(engines), gateway_plans(gateway)
            each = {
                url: {k: v - each_before[url][k] for k, v in engine_counters([url]).items()}
                for url in state["prefill"]
            }
            run = {
                "workload": workload.name, "mode": mode, "repeat": repeat, "seed": run_seed,
                **summary(times, job_s),
                "tokens": {k: after[k] - before[k] for k in after},
                "prefills": each,
                "plans": {k: v - plans_before.get(k, 0.0) for k, v in plans_after.items()
                          if v - plans_before.get(k, 0.0)},
            }  # fmt: skip
            runs.append(run)
            print(f"   {mode} #{repeat + 1}: TTFT p50 {run['ttft_p50'] * 1000:.0f} ms, "
                  f"p90 {run['ttft_p90'] * 1000:.0f} ms; subagents' first p50 "
                  f"{run['fork_ttft_p50'] * 1000:.0f} ms; job {job_s:.1f} s; "
                  f"tokens {run['tokens']}; forks {run['fork_plans']}", flush=True)  # fmt: skip
        if answers:
            replies = {}
            for mode in MODES:
                wait_idle(engines)
                times, _ = asyncio.run(
                    replay(workload, urls[mode], model, seed + 7, salt=f"{mode}-{uuid.uuid4()}")
                )
                replies[mode] = {(t.agent, t.turn): t.text for t in times}
            same = sum(replies["kvturn"][k] == v for k, v in replies["vllm-pd"].items())
            checked = {"compared": len(replies["vllm-pd"]), "equal": same}
            print(f"   answers: {same} of {len(replies['vllm-pd'])} equal", flush=True)
    return {"workload": asdict(workload), "router": router_command, "runs": runs,
            "answers": checked}  # fmt: skip


def _ratio(kv: list[float], base: list[float]) -> str:
    ratios = [k / b for k in kv for b in base if b and k == k and b == b]
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _ms(values: list[float]) -> str:
    if any(v != v for v in values):  # NaN: nothing of the kind ran
        return "-"
    low, high = min(values) * 1000, max(values) * 1000
    return f"{statistics.median(values) * 1000:.0f} ({low:.0f}-{high:.0f})"


def report(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Subagent fan-out: kvturn beside vLLM P/D as deployed",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, this machine (2 CPU cores), "
        "tiny model, 1 prefill (2 where said) + 1 decode, prefill's prefix cache on in both "
        "modes. Values: "
        "median (min-max) over the repeats; ratios kvturn / vllm-pd as the median over every "
        "kvturn run against every vllm-pd run (range in brackets).",
        "",
    ]
    for result in results:
        w = result["workload"]
        lines += [f"## {w['name']}", "", w["what"], "", f"Baseline: `{result['router']}`", ""]
        lines += ["| mode | TTFT p50 ms | TTFT p90 ms | subagents' first TTFT p50 ms | p90 ms "
                  "| job s | prompt tokens computed | from prefix caches | over NIXL |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        by_mode = {m: [r for r in result["runs"] if r["mode"] == m] for m in MODES}
        for mode, runs in by_mode.items():
            if not runs:
                continue

            def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
                return [float(r[key]) for r in runs]

            tokens = [r["tokens"] for r in runs]
            lines.append(
                f"| {mode} | {_ms(col('ttft_p50'))} | {_ms(col('ttft_p90'))} "
                f"| {_ms(col('fork_ttft_p50'))} | {_ms(col('fork_ttft_p90'))} "
                f"| {statistics.median(col('job_s')):.1f} "
                f"({min(col('job_s')):.1f}-{max(col('job_s')):.1f}) "
                f"| {statistics.median(t['computed'] for t in tokens):,.0f} "
                f"| {statistics.median(t['cached'] for t in tokens):,.0f} "
                f"| {statistics.median(t['received'] for t in tokens):,.0f} |"
            )
        if w["prefills"] > 1:
            lines += ["", "Prompt tokens each prefill computed / served from its prefix cache "
                      f"(median over the repeats; the shared prompt is {w['system_tokens']:,} "
                      "tokens):", "", "| mode | " + " | ".join(
                          f"prefill {i + 1}" for i in range(w["prefills"])) + " |",
                      "|---|" + "---|" * w["prefills"]]  # fmt: skip
            for mode, runs in by_mode.items():
                cells = []
                for url in sorted(runs[0]["prefills"]) if runs else []:
                    computed = statistics.median(r["prefills"][url]["computed"] for r in runs)
                    cached = statistics.median(r["prefills"][url]["cached"] for r in runs)
                    cells.append(f"{computed:,.0f} / {cached:,.0f}")
                if cells:
                    lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        kv, base = by_mode["kvturn"], by_mode["vllm-pd"]
        if kv and base:
            lines += ["", "| kvturn / vllm-pd | ratio |", "|---|---|"]
            for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p90", "TTFT p90"),
                               ("fork_ttft_p50", "subagents' first TTFT p50"),
                               ("fork_ttft_p90", "subagents' first TTFT p90"),
                               ("job_s", "job")):  # fmt: skip
                lines.append(
                    f"| {label} | {_ratio([r[key] for r in kv], [r[key] for r in base])} |"
                )
            plans = sorted({p for r in kv for p in r["fork_plans"]})
            if plans:
                lines += ["", f"kvturn's plans for subagents' first turns: {', '.join(plans)}."]
        if result["answers"]:
            a = result["answers"]
            lines += ["", f"Answers (one more run of each mode, one seed, greedy): {a['equal']} "
                      f"of {a['compared']} replies equal."]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                        choices=sorted(WORKLOADS))  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--answers", action="store_true", help="compare every reply across modes")
    parser.add_argument("--out", default=str(RESULTS / "fanout"))
    args = parser.parse_args()
    command = "benchmarks/fanout.py " + " ".join(sys.argv[1:])
    results = [run_workload(WORKLOADS[w], args.repeats, args.seed, args.answers)
               for w in args.workloads]  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(report(results, command))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
