"""kvturn beside "vLLM P/D as deployed", measured by AIPerf's synthetic multi-turn workload.

Set-up (AIPerf and vllm-router each pin their own dependencies: a venv each):

    python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    python3.11 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17

Run:

    .venv/bin/python benchmarks/aiperf_multiturn.py                 # every workload, 3 repeats
    .venv/bin/python benchmarks/aiperf_multiturn.py --workloads roomy --repeats 1

For each workload one deployment is started (``kvturn up``: engines and the gateway) and both
modes run on those same engine processes, interleaved, each ``--repeats`` times (the order of
the modes alternates from one repeat to the next):

``vllm-pd``
    What a vLLM user runs today: P/D with vLLM's prefix cache on every engine, behind
    vllm-router 0.1.17 in P/D mode (``--vllm-pd-disaggregation``) with its ``consistent_hash``
    policy, session affinity keyed on ``X-Session-ID``, which AIPerf sends
    (``--session-header``). Decode keeps nothing of a request once it is done
    (``kvturn up --no-retain-untracked``: no request of vllm-router's carries a kvturn
    conversation, and plain P/D has no bidirectional retention); the engines run kvturn's
    connector only so that its CPU fixes (NIXL's progress thread, core pinning, idle pacing)
    apply to both modes alike.
``kvturn``
    The gateway ``kvturn up`` started, in front of the same engines; the same AIPerf command
    with the same session header.
``kvturn-no-id``
    (some workloads) The same without a session header: kvturn recognises a resent history.
``one-engine``
    (roomy, long-histories) Not a deployment to compare with but a bound: AIPerf straight to
    the decode engine, no P/D, no router, no gateway, every turn served from that engine's own
    prefix cache. A decode-local turn of kvturn's is this at best (the same engine computes the same
    suffix); where kvturn's ratio over vllm-pd is this one's, no plan of kvturn's could do
    better on these engines (with long histories it is not one: one engine also queues every
    later turn behind the long first turns, which P/D keeps on prefill).

AIPerf runs unmodified (``aiperf profile``), with greedy sampling (``temperature:0``). Every run
draws its own prompts (its own ``--random-seed``), so no run finds another's prompts in any
engine's cache; a run's ``job`` time is AIPerf's benchmark duration, the time its agents took to
finish all their turns. Beside AIPerf's figures, each run's engine counters: prompt tokens each
engine computed, served from its own prefix cache, or received over NIXL; the gateway's turns by
plan and reason; and the CPU seconds the prefill engines, the decode engines, the gateway, AIPerf
and the whole machine used (on a 2-core machine every part competes for the same cores).
AIPerf's scrape of the target's ``/metrics`` is off (``--no-server-metrics``): only the gateway
serves one where AIPerf looks, so only kvturn's runs were scraped. Results written before it was
turned off had it on: each results file's AIPerf command shows which.

Results: ``benchmarks/results/aiperf_multiturn.md`` (and ``aiperf_multiturn.json``, every run);
measured again with the CPU each part used, ``roomy``: ``aiperf_roomy.md``, ``two-prefills``:
``aiperf_two_prefills.md`` and ``beyond-prefill-cache``: ``aiperf_beyond_prefill_cache.md``;
``long-histories`` and ``tool-pauses-loaded``: ``aiperf_long_and_loaded.md``;
``tool-pauses-long-agents``: ``aiperf_long_agents.md`` (with ``--issue-every-ms 1``:
``aiperf_long_agents_paced.md``); ``large-tool-results``:
``aiperf_large_tool_results.md`` (its variant ``large-tool-results-pull-1024``, not in the
default set: ``aiperf_large_tool_results_pull_1024.md``); ``two-decodes`` and ``two-decodes-roomy``:
``aiperf_two_decodes.md`` and ``aiperf_two_decodes_roomy.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _pair import (
    ROOT,
    ROUTER_BIN,
    ROUTER_PORT,
    SESSION_HEADER,
    as_deployed,
    engine_counters,
    gateway_plan_reasons,
    interleaved,
    machine_busy_seconds,
    process_cpu_seconds,
    ratio,
    shown,
    spread,
    tree_cpu_seconds,
    wait_idle,
)

RESULTS = Path(__file__).parent / "results"
AIPERF_BIN = ROOT / ".venv-aiperf" / "bin" / "aiperf"
GATEWAY_PORT = 28000
MODES = ("vllm-pd", "kvturn", "kvturn-no-id", "one-engine")
#: AIPerf's figures a run reports (its ``profile_export_aiperf.json``).
TTFT, LATENCY = "time_to_first_token", "request_latency"


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    conversations: int
    turns: int
    delay_ms: int
    concurrency: int
    shared_system: int = 1000
    user_context: int = 1500
    isl: int = 300
    osl: int = 24
    prefill: int = 1
    decode: int = 1
    #: KV blocks (128 tokens each) per engine; None: the whole ``kv_cache_gb``.
    prefill_blocks: int | None = None
    decode_blocks: int | None = None
    modes: tuple[str, ...] = ("vllm-pd", "kvturn")
    up_args: tuple[str, ...] = field(default=())

    def aiperf_args(self) -> list[str]:
        return [
            "--conversation-num", str(self.conversations),
            "--num-dataset-entries", str(self.conversations),
            "--conversation-turn-mean", str(self.turns),
            "--conversation-turn-stddev", "0",
            "--conversation-turn-delay-mean", str(self.delay_ms),
            "--conversation-turn-delay-stddev", str(self.delay_ms // 4),
            "--shared-system-prompt-length", str(self.shared_system),
            "--user-context-prompt-length", str(self.user_context),
            "--isl", str(self.isl), "--isl-stddev", "0",
            "--osl", str(self.osl), "--osl-stddev", "0",
            "--concurrency", str(self.concurrency),
        ]  # fmt: skip


#: The issue's cases where the baseline can lose (beyond prefill's cache, several prefills or
#: decodes, long tool pauses under pressure, light, loaded and with longer agents; decode-local
#: with long histories or long tool results), and the ones where it should not (roomy, with one
#: decode or two).
#: Token counts: the tiny model's tokenizer is byte-level; a conversation ends near
#: shared + context + turns x (isl + osl) tokens (about 4.4k here: 35 blocks of 128; 14.9k with
#: long-histories' 12k-token context). AIPerf's concurrency is the number of conversations under
#: way at once: their histories are the working set. The KV caps hold in both modes (the same
#: engines): a decode pool with more KV than a prefill pool, as P/D deployments are sized
#: (decode holds every running context).
WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "roomy",
            "memory to spare (2 GiB of KV per engine, about 500k tokens): the issue's first "
            "AIPerf workload, twice the conversations; a conversation continues on its decode "
            "(decode-local), no transfer",
            conversations=16,
            turns=6,
            delay_ms=1500,
            concurrency=4,
            modes=("vllm-pd", "kvturn", "kvturn-no-id", "one-engine"),
        ),
        Workload(
            "beyond-prefill-cache",
            "working set beyond prefill's cache: 6 conversations under way (~26k tokens of "
            "history) against 96 blocks (12k tokens) of prefill KV; decode has 400 blocks (51k)",
            conversations=16,
            turns=6,
            delay_ms=1500,
            concurrency=6,
            prefill_blocks=96,
            decode_blocks=400,
        ),
        Workload(
            "beyond-prefill-cache-loaded",
            "beyond-prefill-cache with twice the agents under way: 12 of 24 conversations at "
            "once (~53k tokens of history) against 96 blocks of prefill KV and 800 of decode",
            conversations=24,
            turns=6,
            delay_ms=1500,
            concurrency=12,
            prefill_blocks=96,
            decode_blocks=800,
        ),
        Workload(
            "two-prefills",
            "2 prefills (64 blocks, 8k tokens, each) + 1 decode (400 blocks): placement by hash "
            "of X-Session-ID (vllm-router) against by what the engines hold (kvturn)",
            conversations=12,
            turns=6,
            delay_ms=1500,
            concurrency=6,
            prefill=2,
            prefill_blocks=64,
            decode_blocks=400,
        ),
        Workload(
            "two-prefills-loaded",
            "two-prefills with twice the agents under way: 12 of 24 conversations at once "
            "(~53k tokens of history) against 2 prefills of 64 blocks each and a decode of 800",
            conversations=24,
            turns=6,
            delay_ms=1500,
            concurrency=12,
            prefill=2,
            prefill_blocks=64,
            decode_blocks=800,
        ),
        Workload(
            "tool-pauses",
            "long tool pauses under pressure: 8 s think time, 8 conversations under way "
            "(~35k tokens of history) against 96 blocks of prefill KV and 320 of decode",
            conversations=12,
            turns=5,
            delay_ms=8000,
            concurrency=8,
            prefill_blocks=96,
            decode_blocks=320,
        ),
        Workload(
            "long-histories",
            "decode-local with long histories and memory to spare: a 12,000-token user "
            "context, so first turns are long prefills; a baseline turn's suffix queues behind "
            "them on prefill (decode's own prefix cache holds the rest of its history), a "
            "decode-local turn's does not",
            conversations=12,
            turns=6,
            delay_ms=1500,
            concurrency=4,
            user_context=12000,
            modes=("vllm-pd", "kvturn", "one-engine"),
        ),
        Workload(
            "tool-pauses-loaded",
            "long tool pauses with the engines loaded: 8 s think time, 24 conversations under "
            "way (~100k tokens of history) against 96 blocks of prefill KV and 960 of decode",
            conversations=24,
            turns=5,
            delay_ms=8000,
            concurrency=24,
            prefill_blocks=96,
            decode_blocks=960,
        ),
        Workload(
            "large-tool-results",
            "decode-local with memory to spare, agents whose tools are fast and answer at "
            "length: 1,500-token turns, 0.5 s think time, 8 turns, 8 under way (histories reach "
            "~15k tokens); the baseline's one prefill computes every turn's new tokens, "
            "kvturn's go to the decode that holds the history or to prefill, whichever its "
            "costs say is sooner",
            conversations=16,
            turns=8,
            delay_ms=500,
            concurrency=8,
            isl=1500,
        ),
        Workload(
            "large-tool-results-pull-1024",
            "large-tool-results with prefill skipping pulls of under 1,024 tokens (vLLM's "
            "kv_recompute_threshold, 64 by default; `kvturn up --recompute-threshold 1024`, "
            "which also sets the gateway's reuse threshold): on a busy CPU prefill a pull "
            "waits about two of its steps, longer than computing a few hundred tokens",
            conversations=16,
            turns=8,
            delay_ms=500,
            concurrency=8,
            isl=1500,
            up_args=("--recompute-threshold", "1024"),
        ),
        Workload(
            "tool-pauses-long-agents",
            "long tool pauses under pressure, longer agents: tool-pauses-loaded's 24 agents "
            "under way and 8 s think time, with 8 turns each instead of 5 (~120k tokens of "
            "history at the end) against 96 blocks of prefill KV and 1280 of decode",
            conversations=24,
            turns=8,
            delay_ms=8000,
            concurrency=24,
            prefill_blocks=96,
            decode_blocks=1280,
        ),
        *(
            Workload(
                f"tool-pauses-long-agents-{seconds}s",
                f"tool-pauses-long-agents with {seconds} s tool pauses instead of 8 s: the same "
                "agents, engines and KV, less of the job in think time (AIPerf sleeps every "
                "pause, whoever serves the turns: the job's floor)",
                conversations=24,
                turns=8,
                delay_ms=seconds * 1000,
                concurrency=24,
                prefill_blocks=96,
                decode_blocks=1280,
            )
            for seconds in (2, 4)
        ),
        Workload(
            "two-decodes",
            "1 prefill (96 blocks) + 2 decodes (240 blocks, 31k tokens, each): 8 conversations "
            "under way (~35k tokens of history); the baseline picks a conversation's decode by "
            "hash of X-Session-ID; kvturn keeps it on the decode that holds it and starts a new "
            "one on the least loaded",
            conversations=16,
            turns=6,
            delay_ms=1500,
            concurrency=8,
            decode=2,
            prefill_blocks=96,
            decode_blocks=240,
        ),
        Workload(
            "two-decodes-roomy",
            "1 prefill + 2 decodes with memory to spare (2 GiB of KV each): every history "
            "stays in prefill's cache too, so what is left to compare is the hop to prefill, "
            "the transfer back and where each conversation's decode is",
            conversations=16,
            turns=6,
            delay_ms=1500,
            concurrency=8,
            decode=2,
        ),
        Workload(
            "smoke",
            "a check that every part runs (not a measurement)",
            conversations=2,
            turns=2,
            delay_ms=200,
            concurrency=2,
            modes=("vllm-pd", "kvturn", "kvturn-no-id"),
        ),
    )
}
#: What the full run measures (``smoke`` only checks the set-up).
DEFAULT_WORKLOADS = (
    "roomy", "long-histories", "beyond-prefill-cache", "two-prefills", "tool-pauses",
    "tool-pauses-loaded", "tool-pauses-long-agents", "large-tool-results", "two-decodes",
    "two-decodes-roomy",
)  # fmt: skip


# ---- one AIPerf run ----------------------------------------------------------------------------


def run_aiperf(
    workload: Workload,
    mode: str,
    url: str,
    model: str,
    tokenizer: str,
    seed: int,
    out: Path,
    outputs: bool = False,
    pace: tuple[str, ...] = (),
) -> dict[str, Any]:
    command = [
        str(AIPERF_BIN), "profile",
        "--model", model,
        "--tokenizer", tokenizer,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--random-seed", str(seed),
        "--extra-inputs", "temperature:0",
        "--ui-type", "none",
        "--artifact-dir", str(out),
        *workload.aiperf_args(),
        *(["--session-header", SESSION_HEADER] if mode != "kvturn-no-id" else []),
        # AIPerf scrapes the URL's /metrics by default: the gateway's, but not the router's (it
        # serves none on its port), so only kvturn's runs were scraped (a probe found AIPerf's
        # CPU no different without). This script reads the engines' and the gateway's counters.
        "--no-server-metrics",
        *pace,
        *(["--export-outputs-json"] if outputs else []),
    ]  # fmt: skip
    started = time.monotonic()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, cwd=out.parent, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - started
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (reaped.ru_utime + reaped.ru_stime) - (children.ru_utime + children.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")  # fmt: skip
    exported = next(out.rglob("profile_export_aiperf.json"))
    data = json.loads(exported.read_text())
    return {"command": shown(tuple(command)), "wall_s": wall, "aiperf": data, "cpu_s": cpu}


def cpu_seconds(state: dict[str, Any]) -> dict[str, float]:
    """CPU seconds used so far: by the prefill engines, the decode engines (each with its
    engine-core process), the gateway (``kvturn up``'s own process, where it runs), and the
    whole machine. Over a run, the machine's minus these and AIPerf's is the router's, this
    script's and the system's."""
    pids = [int(p) for p in state["pids"]]
    prefill = len(state["prefill"])
    return {
        "prefill": tree_cpu_seconds(pids[:prefill]),
        "decode": tree_cpu_seconds(pids[prefill:]),
        "gateway": process_cpu_seconds(int(state["launcher_pid"])),
        "machine": machine_busy_seconds(),
        "wall": time.monotonic(),
    }


def answers(out: Path) -> dict[tuple[str, int], str]:
    """Each turn's reply text, by (AIPerf's conversation id, turn index)."""
    turns: dict[tuple[str, int], str] = {}
    for record in _records(json.loads(next(out.rglob("outputs.json")).read_text())):
        meta = record.get("metadata") or record
        key = (str(meta.get("conversation_id")), int(meta.get("turn_index") or 0))
        turns[key] = _text(record)
    return turns


def _records(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        for value in data.values():
            if isinstance(value, list):
                return [v for v in value if isinstance(v, dict)]
        return []
    return [v for v in data if isinstance(v, dict)]


def _text(record: dict[str, Any]) -> str:
    for key in ("response_text", "output", "text", "generated_text"):
        if key in record:
            value = record[key]
            if value is None:  # no content came back (AIPerf counts the turn as an error)
                return ""
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return json.dumps({k: v for k, v in record.items() if k != "metadata"}, sort_keys=True)


def metric(data: dict[str, Any], name: str, stat: str) -> float | None:
    """One statistic of an AIPerf metric (``avg``, ``p50``, ``p90``...), or None."""
    records = data.get("records", data)
    entry = records.get(name) if isinstance(records, dict) else None
    if isinstance(entry, dict) and stat in entry:
        return float(entry[stat])
    return None


# ---- one workload ------------------------------------------------------------------------------


@contextlib.contextmanager
def deployed(workload: Workload) -> Iterator[tuple[dict[str, Any], str, dict[str, str]]]:
    """The workload's engines, with the router and kvturn's gateway in front: the deployment's
    state, the router's command, and where each mode sends its requests."""
    up_args = [
        "--prefill", str(workload.prefill), "--decode", str(workload.decode),
        *(["--prefill-kv-blocks", str(workload.prefill_blocks)] if workload.prefill_blocks else []),
        *workload.up_args,
    ]  # fmt: skip
    print(f"== {workload.name}: starting engines", flush=True)
    with as_deployed(
        gateway_port=GATEWAY_PORT,
        kv_cache_gb=2,
        decode_kv_blocks=workload.decode_blocks,
        extra_args=tuple(up_args),
    ) as (state, router_command):
        gateway = str(state["gateway"]).removesuffix("/v1")
        urls = {"vllm-pd": f"http://127.0.0.1:{ROUTER_PORT}", "kvturn": gateway,
                "kvturn-no-id": gateway, "one-engine": str(state["decode"][0])}  # fmt: skip
        yield state, router_command, urls


def replay(workload: Workload, seed: int, pace: tuple[str, ...] = ()) -> dict[str, Any]:
    """One timed run's prompts (AIPerf's ``seed``) through every mode, untimed: are the replies
    equal, and which turns came back without content in each mode? (A tiny model with random
    weights ends some replies at their first token; AIPerf counts such a turn as an error.)"""
    with deployed(workload) as (state, _, urls):
        work = Path(tempfile.mkdtemp(prefix=f"kvturn-replay-{workload.name}-"))
        checked = compare_answers(workload, state, urls, work, seed)
    for mode in workload.modes:
        empty = sorted(
            f"{c}#{t}" for (c, t), text in answers(work / f"answers-{mode}").items()
            if not text.strip()
        )  # fmt: skip
        checked["modes"].setdefault(mode, {})["empty"] = empty
        print(f"     {mode}: no content in {', '.join(empty) or 'no turn'}", flush=True)
    return checked


def run_workload(
    workload: Workload,
    repeats: int,
    seed: int,
    check_answers: bool = False,
    pace: tuple[str, ...] = (),
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with deployed(workload) as (state, router_command, urls):
        engines = state["prefill"] + state["decode"]
        gateway = urls["kvturn"]
        work = Path(tempfile.mkdtemp(prefix=f"kvturn-aiperf-{workload.name}-"))
        for repeat, mode in interleaved(workload.modes, repeats):
            run_seed = seed + 100 * repeat + MODES.index(mode)
            wait_idle(engines)
            before = engine_counters(engines)
            reasons_before = gateway_plan_reasons(gateway)
            cpu_before = cpu_seconds(state)
            print(f"   {mode} (repeat {repeat + 1}, seed {run_seed})", flush=True)
            result = run_aiperf(
                workload, mode, urls[mode], str(state["model"]), str(state["model_path"]),
                run_seed, work / f"{mode}-{repeat}", pace=pace,
            )  # fmt: skip
            cpu_after = cpu_seconds(state)
            wait_idle(engines)
            after = engine_counters(engines)
            reasons_after = gateway_plan_reasons(gateway)
            data = result["aiperf"]
            reasons = {k: v - reasons_before.get(k, 0.0) for k, v in reasons_after.items()
                       if v - reasons_before.get(k, 0.0)}  # fmt: skip
            plans: dict[str, float] = {}
            for key, n in reasons.items():  # every turn is counted under one plan/reason
                plan = key.split("/", 1)[0]
                plans[plan] = plans.get(plan, 0.0) + n
            run = {
                "workload": workload.name,
                "mode": mode,
                "repeat": repeat,
                "seed": run_seed,
                "command": result["command"],
                "ttft_avg": metric(data, TTFT, "avg"),
                "ttft_p50": metric(data, TTFT, "p50"),
                "ttft_p90": metric(data, TTFT, "p90"),
                "latency_avg": metric(data, LATENCY, "avg"),
                "job_s": (metric(data, "benchmark_duration", "avg") or result["wall_s"]),
                "requests": metric(data, "request_count", "avg"),
                "errors": metric(data, "error_request_count", "avg") or 0.0,
                "tokens": {k: after[k] - before[k] for k in after},
                "reasons": reasons,
                "cpu_s": {**{k: cpu_after[k] - cpu_before[k] for k in cpu_after},
                          "aiperf": result["cpu_s"]},
                "plans": plans,
                "pauses": pauses_taken(work / f"{mode}-{repeat}"),
            }  # fmt: skip
            runs.append(run)
            print(
                f"     TTFT p50 {run['ttft_p50']} ms p90 {run['ttft_p90']} ms, job "
                f"{run['job_s']:.1f} s, tokens {run['tokens']}, plans {run['plans']}",
                flush=True,
            )
        checked = (
            compare_answers(workload, state, urls, work, seed + 9999, pace)
            if check_answers
            else None
        )
    return {
        "workload": workload.__dict__,
        "router": router_command,
        "runs": runs,
        "answers": checked,
        "artifacts": str(work),
    }


def compare_answers(
    workload: Workload,
    state: dict[str, Any],
    urls: dict[str, str],
    work: Path,
    seed: int,
    pace: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every mode on the same prompts (one seed), greedy: kvturn's replies against vllm-pd's.
    A conversation's later prompts carry its earlier replies, so equal replies mean equal
    prompts all the way. Prefix caches hold the earlier modes' prompts by then: a cache hit
    never changes an answer, which is what this checks."""
    for mode in workload.modes:
        wait_idle(state["prefill"] + state["decode"])
        print(f"   {mode} (answers, seed {seed})", flush=True)
        run_aiperf(
            workload, mode, urls[mode], str(state["model"]), str(state["model_path"]),
            seed, work / f"answers-{mode}", outputs=True, pace=pace,
        )  # fmt: skip
    return answers_compared(workload.modes, work)


def answers_compared(modes: tuple[str, ...], work: Path) -> dict[str, Any]:
    """The replies of the answer runs in ``work`` (``answers-<mode>``), each mode's against the
    first's."""
    replies = {mode: answers(work / f"answers-{mode}") for mode in modes}
    base = replies[modes[0]]
    checked: dict[str, Any] = {"baseline": modes[0], "turns": len(base), "modes": {}}
    for mode, mine in replies.items():
        if mode == modes[0]:
            continue
        differ = sorted(f"{c}#{t}" for (c, t), text in base.items() if mine.get((c, t)) != text)
        empty = sum(1 for text in base.values() if not text.strip())
        checked["modes"][mode] = {"equal": len(base) - len(differ), "differ": differ,
                                  "empty_in_baseline": empty}  # fmt: skip
        print(f"     {mode}: {len(base) - len(differ)}/{len(base)} replies equal", flush=True)
    return checked


# ---- report ------------------------------------------------------------------------------------


def pauses_taken(out: Path) -> dict[str, float]:
    """The think time of one AIPerf run as AIPerf took it, from its own records
    (``profile_export.jsonl``): per conversation, the seconds from each turn's end to the
    next turn's start (the drawn delay, then AIPerf's own queueing of the turn). AIPerf draws
    the delays at random (normal, the workload's mean and a quarter of it as deviation), and
    each mode's runs use seeds of their own (their prompts must not hit the caches the last
    run left), so two runs of one workload sleep different pauses.

    ``longest_s``: the conversation that paused longest; ``total_s``: every conversation's
    pauses (what :func:`job_floor_s` makes the run's floor of)."""
    turns: dict[str, list[tuple[int, int, int]]] = {}
    with next(out.rglob("profile_export.jsonl")).open() as records:
        for line in records:
            meta = json.loads(line)["metadata"]
            turns.setdefault(str(meta["conversation_id"]), []).append(
                (int(meta["turn_index"]), int(meta["request_start_ns"]),
                 int(meta["request_end_ns"]))
            )  # fmt: skip
    paused = []
    for seen in turns.values():
        seen.sort()
        paused.append(sum(b[1] - a[2] for a, b in itertools.pairwise(seen)) / 1e9)
    return {"longest_s": max(paused, default=0.0), "total_s": sum(paused)}


def job_floor_s(run: dict[str, Any], w: dict[str, Any]) -> float:
    """The least job any deployment could take with the pauses ``run`` took
    (:func:`pauses_taken`), even one that answered every turn at once: no conversation ends
    before its own pauses, and at most ``concurrency`` conversations pause at a time. For a run
    from before they were recorded, the pauses at their mean (:func:`pause_floor_s`)."""
    taken = run.get("pauses")
    if not taken:
        return pause_floor_s(w)
    return max(taken["longest_s"], taken["total_s"] / w["concurrency"])


def pause_floor_s(w: dict[str, Any]) -> float:
    """The job's floor: its think time alone. AIPerf runs a conversation's turns one after
    another in one of ``concurrency`` slots and holds the slot through each pause (the roomy
    workload, 16 conversations x 6 turns at concurrency 4, took 43 s: its busiest slot's 30 s
    of pauses plus 24 turns of ~0.45 s; pauses that freed their slots would have let it end
    in about 15 s), so the busiest slot runs ceil(conversations / concurrency) conversations,
    each with ``turns - 1`` pauses of ``delay_ms`` on average. No deployment can finish the
    workload faster: job ratios near 1 where this floor is most of the job say little about
    serving; ``job - floor`` is the part the deployment spent."""
    per_slot = math.ceil(w["conversations"] / w["concurrency"])
    return per_slot * (w["turns"] - 1) * w["delay_ms"] / 1000


def reasons_lines(by_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The gateway's turns by plan and reason a run (median, and min-max over repeats), for the
    modes through it. Runs from before they were recorded: none."""
    lines = []
    for mode, mine in by_mode.items():
        measured = [r.get("reasons") or {} for r in mine]
        keys = sorted({k for reasons in measured for k in reasons})
        if not keys or not all(measured):
            continue
        cells = []
        for key in keys:
            counts = [reasons.get(key, 0.0) for reasons in measured]
            low, high = min(counts), max(counts)
            span = f" ({low:.0f}-{high:.0f})" if low != high else ""
            cells.append(f"{key} {statistics.median(counts):.0f}{span}")
        lines += ["", f"{mode}'s turns by plan/reason a run: " + ", ".join(cells) + "."]
    return lines


def cpu_table(by_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Cores each part kept busy over a run (CPU seconds / wall seconds from AIPerf's start to
    its end, median over repeats): where the machine's time went. Runs from before it was
    measured: none."""
    parts = ("prefill", "decode", "gateway", "aiperf")
    rows = []
    for mode, mine in by_mode.items():
        measured = [r for r in mine if r.get("cpu_s")]
        if not measured:
            continue

        def cores(run: dict[str, Any], part: str) -> float:
            cpu = run["cpu_s"]
            if part == "rest":  # the router, this script, the system
                return (cpu["machine"] - sum(cpu[p] for p in parts)) / cpu["wall"]
            return cpu[part] / cpu["wall"]

        cells = [
            f"{statistics.median(cores(r, part) for r in measured):.2f}"
            for part in (*parts, "rest", "machine")
        ]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        "Cores busy over a run (CPU seconds / seconds from AIPerf's start to its end, which "
        "includes its start-up; median): prefill engines | decode engines | gateway | AIPerf "
        f"| the rest (router, system) | the whole machine ({os.cpu_count()} cores).",
        "",
        "| mode | prefill | decode | gateway | AIPerf | rest | machine |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    date = getattr(args, "date", None) or f"{datetime.now(UTC):%Y-%m-%d %H:%M}"
    lines = [
        "# kvturn beside vLLM P/D as deployed: AIPerf multi-turn",
        "",
        f"Command: `.venv/bin/python benchmarks/aiperf_multiturn.py {' '.join(args.argv)}`",
        f"Date: {date} UTC; machine: {os.cpu_count()} cores shared "
        "by everything below; model: tiny (float32); AIPerf 0.13.0 (unmodified); "
        f"vllm-router 0.1.17; {args.repeats} repeat(s) per mode, interleaved.",
        "",
        "Each cell: median over repeats, (min-max) in brackets. Ratios: kvturn's median over "
        "the baseline's, (range of every kvturn run over every baseline run); a range that "
        "contains 1.00 is a tie. TTFT in ms; job = AIPerf's benchmark duration (s), the time "
        "the workload's agents took to finish. Tokens: prompt tokens the engines computed / "
        "served from their own prefix cache / received over NIXL, per run (median). Job "
        "beyond the floor = job minus the least job any deployment could take with the "
        "run's think time (see the job floors below), the part of the job the deployment "
        "spent; job at the floor = that least job over the baseline's job, the lowest job "
        "ratio any deployment could reach.",
        *([args.notes] if getattr(args, "notes", None) else []),
        "",
    ]
    for result in results:
        w = result["workload"]
        runs = result["runs"]
        lines += [f"## {w['name']}", "", w["what"] + ".", ""]
        lines += [
            f"{w['prefill']} prefill + {w['decode']} decode; AIPerf: {w['conversations']} "
            f"conversations x {w['turns']} turns, {w['delay_ms']} ms think time, "
            f"{w['shared_system']}-token shared system prompt, {w['user_context']}-token user "
            f"context, {w['isl']}-token turns, {w['osl']}-token replies, concurrency "
            f"{w['concurrency']}. Router: `{result['router']}`.",
            "",
            "| mode | TTFT p50 | TTFT p90 | TTFT mean | latency mean | job (s) | computed / "
            "cached / received tokens | plans | errors |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for run in runs:
            by_mode.setdefault(run["mode"], []).append(run)
        for mode, mine in by_mode.items():

            def col(key: str, mine: list[dict[str, Any]] = mine) -> list[float]:
                return [r[key] for r in mine if r[key] is not None]

            tokens = " / ".join(
                f"{statistics.median([r['tokens'][k] for r in mine]) / 1000:.0f}k"
                for k in ("computed", "cached", "received")
            )
            plans: dict[str, float] = {}
            for r in mine:
                for plan, n in r["plans"].items():
                    plans[plan] = plans.get(plan, 0.0) + n / len(mine)
            shown_plans = ", ".join(f"{p} {n:.0f}" for p, n in sorted(plans.items())) or "-"
            lines.append(
                f"| {mode} | {spread(col('ttft_p50'))} | {spread(col('ttft_p90'))} | "
                f"{spread(col('ttft_avg'))} | {spread(col('latency_avg'))} | "
                f"{spread(col('job_s'))} | {tokens} | {shown_plans} | "
                f"{sum(col('errors')):.0f} |"
            )
        lines += reasons_lines(by_mode)
        lines += cpu_table(by_mode)
        base = by_mode.get("vllm-pd", [])
        measured = all(r.get("pauses") for r in runs)
        floors = "; ".join(
            f"{mode} {spread([job_floor_s(r, w) for r in mine])}" for mode, mine in by_mode.items()
        )
        lines += [
            "",
            f"Job floors (s): {floors}: "
            + (
                "the least job a deployment could take with the pauses each run took "
                "(`job_floor_s`, from AIPerf's records: the longest conversation's pauses, or all "
                "pauses shared among the slots, whichever is more)."
                if measured
                else "the busiest AIPerf slot's pauses at their mean (`pause_floor_s`; these "
                "runs are from before the pauses taken were recorded)."
            ),
            "",
            "| kvturn / vllm-pd | TTFT p50 | TTFT p90 | TTFT mean | job | job beyond the "
            "floor | job at the floor |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in ("kvturn", "kvturn-no-id", "one-engine"):
            mine = by_mode.get(mode, [])
            if not mine:
                continue
            cells = [
                ratio([r[k] for r in mine if r[k]], [r[k] for r in base if r[k]])
                for k in ("ttft_p50", "ttft_p90", "ttft_avg", "job_s")
            ]
            cells.append(
                ratio(
                    [r["job_s"] - job_floor_s(r, w) for r in mine],
                    [r["job_s"] - job_floor_s(r, w) for r in base],
                )
            )
            # What a deployment answering every turn at once would get, with this mode's pauses:
            # no job ratio below it is possible.
            cells.append(ratio([job_floor_s(r, w) for r in mine], [r["job_s"] for r in base]))
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        checked = result.get("answers")
        if checked:
            lines.append("")
            for mode, seen in checked["modes"].items():
                lines.append(
                    f"Answers, {mode} against {checked['baseline']} on the same prompts "
                    f"(greedy): {seen['equal']} of {checked['turns']} replies equal"
                    + (f"; differing: {', '.join(seen['differ'])}" if seen["differ"] else "")
                    + f" ({seen['empty_in_baseline']} empty in the baseline too)."
                )
        lines += ["", "AIPerf command of the first run: `" + runs[0]["command"] + "`", ""]
    return "\n".join(lines) + "\n"


def pace(args: argparse.Namespace) -> tuple[str, ...]:
    """AIPerf's pacing arguments. With ``--concurrency`` alone AIPerf issues in its
    ``concurrency-burst`` mode: its credit loop yields to its event loop and tries again while no
    slot is free or every session is in its think time (``timing/strategies/request_rate.py``),
    a busy loop that takes a share of this machine's two cores from the engines. A request rate
    puts it to sleep between intervals instead. Measured on large-tool-results (one repeat a
    mode): AIPerf 0.17-0.22 of a core paced at 1 ms against 0.55-0.59 by default, the engines
    taking the difference, job times inside the default's spreads
    (``results/aiperf_large_tool_results.md``). Off by default: every result so far ran without."""
    if args.issue_every_ms is None:
        return ()
    rate = 1000 / args.issue_every_ms
    return ("--request-rate", f"{rate:g}", "--arrival-pattern", "constant")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)}",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--issue-every-ms", type=float, default=None,
        help="AIPerf issues a request at most this often (--request-rate, constant arrivals; "
        "the concurrency and think-time arguments unchanged, AIPerf takes concurrency under a "
        "rate as a cap on requests in flight), where by default it retries at once while no "
        "slot is free (see pace())",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--output", default="aiperf_multiturn", help="results file stem")
    parser.add_argument(
        "--answers", action="store_true",
        help="after the timed runs, every mode once more on one seed: are the replies equal?",
    )  # fmt: skip
    parser.add_argument(
        "--render", action="store_true",
        help="only write the .md again from the .json of an earlier run (--date, --notes)",
    )  # fmt: skip
    parser.add_argument(
        "--replay-seed", type=int, default=None,
        help="instead of timed runs: one run's prompts (its seed, as its record says) through "
        "every mode of each workload; prints whether the replies are equal and which turns "
        "came back without content",
    )  # fmt: skip
    parser.add_argument("--date", help="with --render: the run's date (UTC, as in its .md)")
    parser.add_argument("--notes", help="with --render: what the run's .md said besides")
    args = parser.parse_args()
    if args.render:
        results = json.loads((RESULTS / f"{args.output}.json").read_text())
        args.argv = results[0].get("argv") or ["--answers"]
        (RESULTS / f"{args.output}.md").write_text(report(results, args))
        return 0
    args.argv = sys.argv[1:]
    for tool in (AIPERF_BIN, ROUTER_BIN):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: see this script's docstring for the set-up")
    if args.replay_seed is not None:
        for name in args.workloads.split(","):
            print(json.dumps(replay(WORKLOADS[name], args.replay_seed, pace(args))), flush=True)
        return 0
    results = []
    for name in args.workloads.split(","):
        results.append(
            run_workload(WORKLOADS[name], args.repeats, args.seed, args.answers, pace(args))
        )
        results[-1]["argv"] = args.argv
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.output}.json").write_text(json.dumps(results, indent=1))
        (RESULTS / f"{args.output}.md").write_text(report(results, args))
    print((RESULTS / f"{args.output}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
