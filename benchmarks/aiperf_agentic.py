"""kvturn against the strongest baselines on AIPerf's agentic-coding workload, equal KV per engine.

Set-up (AIPerf and vllm-router each pin their own dependencies: a venv each):

    python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    python3.11 -m venv .venv-router && .venv-router/bin/pip install vllm-router==0.1.17

Run:

    .venv/bin/python benchmarks/aiperf_agentic.py                       # tight, 3 repeats
    .venv/bin/python benchmarks/aiperf_agentic.py --workloads roomy --repeats 3

The workload is AIPerf's own agentic-coding generator (``aiperf synthesize agentic-code``) with
``benchmarks/agentic_code.json``: its default configuration (sized for GPUs: 32k-token
prefixes, 6k-token turns) scaled down for two CPU cores and the tiny model. Sessions share a
global tools + system prefix, a group prefix (three groups, Zipf), their own session prefix,
and a history that grows by a tool result or user message a turn; 70% of the pauses are short
tool pauses and 30% long human pauses; sessions end at a context limit or by a random reset.
Replies run to their drawn length (``ignore_eos``; median 71 tokens) so streams are long
enough to show inter-token latency. AIPerf replays it unmodified (``--custom-dataset-type
mooncake_trace``), a fixed number of sessions under way at once, each turn's recorded delay
after the last, the history accumulated, greedy sampling.

Every mode runs on the same engine processes (one ``kvturn up``), with the **same KV cache per
engine** on prefill and decode, interleaved, ``--repeats`` times each (the order alternates
from one repeat to the next). Before the timed runs every mode serves a discarded warm-up run
(fresh CPU engines are slow on their first requests; the first timed run would otherwise be
whichever mode goes first).

``vllm-pd``
    vLLM P/D with prefix caching on every engine, behind vllm-router 0.1.17
    (``--vllm-pd-disaggregation``, ``consistent_hash`` on ``X-Session-ID``). Decode keeps
    nothing of a request beyond vLLM's own prefix cache (``--no-retain-untracked``).
``decode-affinity``
    What llm-d's and Dynamo's routers do (``benchmarks/affinity_router.py``): a turn whose
    non-cached part, by an approximate index of what the session's decode was sent, is at most
    500 tokens runs on that decode alone, served from vLLM's LRU prefix cache; any other turn
    goes through P/D. No leases, no release, no SDK.
``kvturn``
    kvturn's gateway as shipped, in front of the same engines, the same session header.
``kvturn-budget-5ms``, ``kvturn-no-budget``, ``kvturn-pull-only``, ``kvturn-no-priority``
    (alternatives, measured to choose the default: :data:`ALTERNATIVES`) another kvturn
    gateway (``kvturn serve``) on the same engines, one per alternative a run names, with its
    flags: ``--local-stall-budget-s 0.005`` (a busy holder's suffix is computed on prefill
    unless its compute fits 5 ms), ``--local-stall-budget-s inf`` (no budget), ``--decode-local
    off`` (every returning turn pulls its history into prefill; decode computes no prompt),
    ``--pull-priority 0`` (a pull's prefill waits its turn behind the recomputes queued there).

Each run records AIPerf's TTFT p50/p90, inter-token latency p50/p99, request latency p50/p90
and the job (AIPerf's benchmark duration); the engines' prompt tokens by source (computed,
served from their prefix cache, received over NIXL); kvturn's plans; the pauses AIPerf took.
Ratios are kvturn's median over each baseline's, with the range over every pair of runs (a
range holding 1.00 is a tie); the "best" column takes, per metric, the baseline with the lowest
median. Results: ``benchmarks/results/aiperf_agentic.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _pair import (
    DECODE_WORK,
    ROOT,
    ROUTER_BIN,
    ROUTER_PORT,
    SESSION_HEADER,
    as_deployed,
    cpu_seconds,
    engine_counters,
    engine_itl_buckets,
    engine_totals,
    gateway_plan_reasons,
    gateway_plans,
    gateway_total,
    histogram_quantile,
    interleaved,
    local_pair,
    server,
    shown,
    wait_idle,
)
from aiperf_multiturn import AIPERF_BIN, answers, job_floor_s, pauses_taken

from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results"
CONFIG = Path(__file__).parent / "agentic_code.json"
GATEWAY_PORT = 28000
#: kvturn gateways with other settings, each on its own port, started where a run names it.
ALTERNATIVES = {
    "kvturn-budget-5ms": (28050, ("--local-stall-budget-s", "0.005")),
    "kvturn-no-budget": (28051, ("--local-stall-budget-s", "inf")),
    "kvturn-pull-only": (28052, ("--decode-local", "off")),
    "kvturn-no-priority": (28053, ("--pull-priority", "0")),
}
AFFINITY_PORT = 29400
BIDIRECTIONAL_PORT = 29500
BLOCK_SIZE = 128
#: The gateway's count of the prompt tokens its decode-local turns were planned to compute.
LOCAL_SUFFIX = "kvturn_local_suffix_tokens_total"
MODES = ("vllm-pd", "decode-affinity", "upstream-bidirectional", "kvturn", *ALTERNATIVES)
BASELINES = ("vllm-pd", "decode-affinity", "upstream-bidirectional")
#: (AIPerf metric, statistic, the key a run records it under)
METRICS = (
    ("time_to_first_token", "p50", "ttft_p50"),
    ("time_to_first_token", "p90", "ttft_p90"),
    ("inter_token_latency", "p50", "itl_p50"),
    ("inter_token_latency", "p99", "itl_p99"),
    ("request_latency", "p50", "latency_p50"),
    ("request_latency", "p90", "latency_p90"),
)
SHOWN = (
    ("TTFT p50", "ttft_p50"), ("TTFT p90", "ttft_p90"), ("ITL p50", "itl_p50"),
    ("ITL p99", "itl_p99"), ("latency p50", "latency_p50"), ("job", "job_s"),
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    sessions: int = 16
    concurrency: int = 8
    #: KV blocks (128 tokens) of every engine, prefill and decode alike; None: 2 GiB each.
    kv_blocks: int | None = None
    #: The generator's seed: the sessions' shapes (lengths, pauses); AIPerf's seed per run
    #: draws the text.
    shape_seed: int = 7
    #: Decode engines set up as upstream's bidirectional NixlConnector: every finished request
    #: no kvturn gateway sent keeps its blocks for the fixed TTL (480 s), never reclaimed
    #: (``kvturn up --retain-untracked``). Plain P/D's baselines cannot share those engines.
    bidirectional: bool = False
    modes: tuple[str, ...] = ("vllm-pd", "decode-affinity", "kvturn", "kvturn-budget-5ms")


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "tight",
            "the sessions' working set beyond one engine's KV but within the pool's: 8 of 16 "
            "sessions under way (histories of 2.5-10k tokens, about 45k tokens at once) against "
            "256 blocks (33k tokens) on each engine, prefill and decode alike",
            kv_blocks=256,
        ),
        Workload(
            "roomy",
            "memory to spare: 2 GiB of KV per engine (about 500k tokens), the same sessions",
            modes=("vllm-pd", "decode-affinity", "kvturn"),
        ),
        Workload(
            "roomy-bidirectional",
            "upstream's bidirectional transfer with memory to spare (2 GiB of KV per engine): "
            "its fixed 480 s retention pins the last turn of every session it served, which "
            "the 256 blocks of tight could not hold",
            bidirectional=True,
            modes=("upstream-bidirectional", "kvturn"),
        ),
        Workload(
            "smoke",
            "a check that every part runs (not a measurement)",
            sessions=4,
            concurrency=2,
            kv_blocks=256,
        ),
    )
}


def synthesize(workload: Workload, into: Path) -> Path:
    """AIPerf's agentic-coding generator's dataset for ``workload`` (its ``dataset.jsonl``)."""
    subprocess.run(
        [str(AIPERF_BIN), "synthesize", "agentic-code", "--num-sessions", str(workload.sessions),
         "--config", str(CONFIG), "--seed", str(workload.shape_seed), "--output", str(into)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return next(into.rglob("dataset.jsonl"))


#: The Hugging Face repo name AIPerf is given for the model's tokenizer (see :func:`hf_cache`).
TOKENIZER_REPO = "kvturn/tiny"


def hf_cache(model_path: Path, into: Path) -> dict[str, str]:
    """AIPerf 0.13's prompt-synthesis workers (trace datasets) force Hugging Face's offline
    mode and then cannot load a tokenizer from a plain folder (``HFValidationError``): lay the
    model folder's tokenizer files out as a cache entry of :data:`TOKENIZER_REPO` under
    ``into`` and return the environment that makes AIPerf read it from there, offline."""
    revision = "0" * 40
    repo = into / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json", "special_tokens_map.json"):  # fmt: skip
        if (model_path / name).exists():
            (snapshot / name).write_bytes((model_path / name).read_bytes())
    return {"HF_HOME": str(into), "HF_HUB_OFFLINE": "1"}


def run_aiperf(
    workload: Workload,
    mode: str,
    url: str,
    state: dict[str, Any],
    dataset: Path,
    seed: int,
    out: Path,
    outputs: bool = False,
    requests: int | None = None,
) -> dict[str, Any]:
    command = [
        str(AIPERF_BIN), "profile",
        "--model", str(state["model"]),
        "--tokenizer", TOKENIZER_REPO,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--custom-dataset-type", "mooncake_trace",
        "--input-file", str(dataset),
        "--isl-block-size", str(BLOCK_SIZE),
        "--no-fixed-schedule",
        "--concurrency", str(workload.concurrency),
        "--random-seed", str(seed),
        "--extra-inputs", "temperature:0",
        "--extra-inputs", "ignore_eos:true",
        "--session-header", SESSION_HEADER,
        # Output tokens as the engine counted them (usage): the tiny model's byte-level ids
        # decode to text that AIPerf's tokenizer counts differently, which skews ITL.
        "--use-server-token-count",
        "--no-server-metrics",
        "--ui-type", "none",
        "--artifact-dir", str(out),
        # Every session once, in the dataset's order (a session's turns in order, the next
        # session started as one ends); the warm-up: its first ``requests`` turns.
        "--dataset-sampling-strategy", "sequential",
        "--request-count", str(requests or sum(1 for _ in dataset.open())),
        *(["--export-outputs-json"] if outputs else []),
    ]  # fmt: skip
    started = time.monotonic()
    env = {**os.environ, **hf_cache(Path(state["model_path"]), out.parent / "hf")}
    done = subprocess.run(
        command, cwd=out.parent, capture_output=True, text=True, timeout=3600, env=env
    )
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")  # fmt: skip
    data = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    return {"command": shown(tuple(command)), "wall_s": wall, "aiperf": data}


def metric(data: dict[str, Any], name: str, stat: str) -> float | None:
    records = data.get("records", data)
    entry = records.get(name) if isinstance(records, dict) else None
    if isinstance(entry, dict) and stat in entry:
        return float(entry[stat])
    return None


def _engine_flags(state: dict[str, Any], *, control: bool = False) -> list[str]:
    keys = [("prefill", "--prefill"), ("decode", "--decode")]
    if control:
        keys.append(("decode_control", "--decode-control"))
    return [a for key, flag in keys for url in state[key] for a in (flag, url)]


@contextlib.contextmanager
def deployed(
    workload: Workload, modes: tuple[str, ...]
) -> Iterator[tuple[dict[str, Any], dict[str, str], dict[str, str]]]:
    """One ``kvturn up`` (equal KV per engine) and the baselines' routers in front of its
    engines: the state, each mode's URL, each router's command."""
    blocks = workload.kv_blocks
    extra = ("--prefill-kv-blocks", str(blocks)) if blocks else ()
    print(f"== {workload.name}: starting engines", flush=True)
    secret = {CONTROL_SECRET_ENV: ""}
    if workload.bidirectional:
        with local_pair(
            gateway_port=GATEWAY_PORT, kv_cache_gb=2, decode_kv_blocks=blocks,
            prefill_prefix_cache=True, extra_args=("--retain-untracked", *extra),
        ) as state:  # fmt: skip
            secret[CONTROL_SECRET_ENV] = state["control_secret"]
            proxy = [
                sys.executable, str(Path(__file__).parent / "bidirectional_proxy.py"),
                *_engine_flags(state, control=True), "--port", str(BIDIRECTIONAL_PORT),
            ]  # fmt: skip
            with server(*proxy, port=BIDIRECTIONAL_PORT, env=secret):
                urls = {
                    "upstream-bidirectional": f"http://127.0.0.1:{BIDIRECTIONAL_PORT}",
                    "kvturn": str(state["gateway"]).removesuffix("/v1"),
                }
                yield state, urls, {"upstream-bidirectional": shown(tuple(proxy))}
        return
    with as_deployed(
        gateway_port=GATEWAY_PORT, kv_cache_gb=2, decode_kv_blocks=blocks, extra_args=extra
    ) as (state, router_command):
        secret[CONTROL_SECRET_ENV] = state["control_secret"]
        # 2 GiB of the tiny model's KV: 4,096 blocks (kvturn up's log says so); the index's
        # capacity is what the decode holds.
        affinity = [
            sys.executable, str(Path(__file__).parent / "affinity_router.py"),
            *_engine_flags(state), "--port", str(AFFINITY_PORT),
            "--decode-blocks", str(blocks or 4096),
        ]  # fmt: skip
        with contextlib.ExitStack() as stack:
            stack.enter_context(server(*affinity, port=AFFINITY_PORT))
            urls = {
                "vllm-pd": f"http://127.0.0.1:{ROUTER_PORT}",
                "decode-affinity": f"http://127.0.0.1:{AFFINITY_PORT}",
                "kvturn": str(state["gateway"]).removesuffix("/v1"),
            }
            routers = {"vllm-pd": router_command, "decode-affinity": shown(tuple(affinity))}
            for mode in modes:
                if mode not in ALTERNATIVES:
                    continue
                port, flags = ALTERNATIVES[mode]
                command = [
                    sys.executable, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(port),
                    *flags, *_engine_flags(state, control=True),
                ]  # fmt: skip
                stack.enter_context(server(*command, port=port, env=secret))
                urls[mode] = f"http://127.0.0.1:{port}"
                routers[mode] = shown(tuple(command))
            yield state, urls, routers


def routed(mode: str, url: str) -> dict[str, int]:
    """A baseline router's counts so far (how it served turns: decode alone or P/D; pulled
    or plain), from its ``/health``; kvturn's plans come from its metrics instead."""
    if mode not in ("decode-affinity", "upstream-bidirectional"):
        return {}
    counts = httpx.get(f"{url}/health", timeout=30).json()
    return {k: int(v) for k, v in counts.items() if isinstance(v, int)}


def wait_leases_ended(state: dict[str, Any], timeout_s: float = 150) -> float:
    """Until no decode holds a lease (kvturn's conversations, which AIPerf never releases, end
    when their leases lapse): the next run, of whichever mode, starts with the same free KV.
    Returns the seconds waited."""
    auth = {"Authorization": f"Bearer {state['control_secret']}"}
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        held = sum(
            int(httpx.get(f"{url}/kvturn/leases", headers=auth, timeout=30).json()["blocks_held"])
            for url in state["decode_control"]
        )
        if held == 0:
            break
        time.sleep(1)
    return time.monotonic() - started


def run_workload(
    workload: Workload,
    repeats: int,
    seed: int,
    check_answers: bool,
    warmup_requests: int,
    modes: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    modes = modes or workload.modes
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix=f"kvturn-agentic-{workload.name}-"))
    dataset = synthesize(workload, work / "dataset")
    with deployed(workload, modes) as (state, urls, routers):
        engines = state["prefill"] + state["decode"]
        for mode in modes:  # discarded: every mode's first requests on these engines
            print(f"   {mode} (warm-up, {warmup_requests} requests)", flush=True)
            run_aiperf(workload, mode, urls[mode], state, dataset, seed - 1 - MODES.index(mode),
                       work / f"warmup-{mode}", requests=warmup_requests)  # fmt: skip
            wait_idle(engines)
            if not workload.bidirectional:
                wait_leases_ended(state)
        for repeat, mode in interleaved(modes, repeats):
            run_seed = seed + 100 * repeat + MODES.index(mode)
            wait_idle(engines)
            if not workload.bidirectional:
                wait_leases_ended(state)
            before = engine_counters(engines)
            itl_before, cpu_before = engine_itl_buckets(state["decode"]), cpu_seconds()
            work_before = engine_totals(state["decode"], DECODE_WORK)
            # The plans of the gateway this mode runs through (the default's for a baseline).
            gateway_url = urls[mode] if mode.startswith("kvturn") else urls["kvturn"]
            reasons_before = gateway_plan_reasons(gateway_url)
            local_before = gateway_total(gateway_url, LOCAL_SUFFIX)
            ttft_before = first_tokens_by_plan(gateway_url)
            routed_before = routed(mode, urls[mode])
            print(f"   {mode} (repeat {repeat + 1}, seed {run_seed})", flush=True)
            out = work / f"{mode}-{repeat}"
            result = run_aiperf(workload, mode, urls[mode], state, dataset, run_seed, out)
            wait_idle(engines)
            after = engine_counters(engines)
            itl_after, cpu_after = engine_itl_buckets(state["decode"]), cpu_seconds()
            work_after = engine_totals(state["decode"], DECODE_WORK)
            steps = {k: v - work_before[k] for k, v in work_after.items()}
            reasons_after = gateway_plan_reasons(gateway_url)
            local_after = gateway_total(gateway_url, LOCAL_SUFFIX)
            ttft_after = first_tokens_by_plan(gateway_url)
            routed_after = routed(mode, urls[mode])
            data = result["aiperf"]
            run: dict[str, Any] = {
                "mode": mode, "repeat": repeat, "seed": run_seed, "command": result["command"],
                **{key: metric(data, name, stat) for name, stat, key in METRICS},
                "job_s": metric(data, "benchmark_duration", "avg") or result["wall_s"],
                "requests": metric(data, "request_count", "avg"),
                "errors": metric(data, "error_request_count", "avg") or 0.0,
                "tokens": {k: after[k] - before[k] for k in after},
                "reasons": {k: v - reasons_before.get(k, 0.0) for k, v in reasons_after.items()
                            if v - reasons_before.get(k, 0.0)},
                "pauses": pauses_taken(out),
                "routed": {k: v - routed_before.get(k, 0) for k, v in routed_after.items()},
                # The decode engines' own ITL (vLLM's histogram, its coarse buckets), before
                # any router relays a token, and the CPU seconds each process took in the run.
                **{f"engine_itl_{name}": None if (v := histogram_quantile(
                    itl_before, itl_after, q)) is None else v * 1000
                   for name, q in (("p50", 0.5), ("p99", 0.99))},
                # What decode's steps ran beside its streams: prompt tokens it computed (a
                # local suffix, a recompute after preemption) and its preemptions.
                "decode_prompt_tokens": steps["vllm:iteration_tokens_total_sum"]
                - steps["vllm:generation_tokens_total"],
                "decode_preemptions": steps["vllm:num_preemptions_total"],
                # Of which kvturn's decode-local turns were planned to compute (their suffixes).
                "local_suffix_tokens": local_after - local_before if mode.startswith("kvturn")
                else None,
                # The gateway's own first tokens by plan in the run: [seconds, turns].
                "ttft_by_plan": {
                    plan: [total - ttft_before.get(plan, (0.0, 0.0))[0],
                           turns - ttft_before.get(plan, (0.0, 0.0))[1]]
                    for plan, (total, turns) in ttft_after.items()
                } if mode.startswith("kvturn") else None,
                "cpu_s": {k: round(v - cpu_before.get(k, 0.0), 1)
                          for k, v in cpu_after.items() if v - cpu_before.get(k, 0.0) >= 1.0},
            }  # fmt: skip
            runs.append(run)
            # Every run on disk as it ends: a run cut short keeps what it measured.
            (work / "runs.json").write_text(json.dumps(runs, indent=1))
            shown_now = [f"{label} {run[key]:.1f}" for label, key in SHOWN if run[key] is not None]
            shown_now += [
                f"engine ITL {k} {run[f'engine_itl_{k}']:.1f}"
                for k in ("p50", "p99")
                if run[f"engine_itl_{k}"] is not None
            ]
            print(f"     cpu {run['cpu_s']}, decode prompt tokens "
                  f"{run['decode_prompt_tokens']:.0f}, preemptions "
                  f"{run['decode_preemptions']:.0f}, planned local suffixes "
                  f"{run['local_suffix_tokens'] or 0:.0f}", flush=True)  # fmt: skip
            print(f"     {', '.join(shown_now)}, errors {run['errors']:.0f}, tokens "
                  f"{run['tokens']}, plans {run['reasons']}", flush=True)  # fmt: skip
        checked = None
        if check_answers:
            for mode in modes:
                print(f"   {mode} (answers, seed {seed + 9999})", flush=True)
                run_aiperf(workload, mode, urls[mode], state, dataset, seed + 9999,
                           work / f"answers-{mode}", outputs=True)  # fmt: skip
            replies = {mode: answers(work / f"answers-{mode}") for mode in modes}
            base = replies[modes[0]]
            checked = {
                mode: {"equal": sum(replies[mode].get(k) == v for k, v in base.items()),
                       "turns": len(base)}
                for mode in modes[1:]
            }  # fmt: skip
            print(f"     answers: {checked}", flush=True)
    return {
        "workload": asdict(workload),
        "routers": routers,
        "runs": runs,
        "answers": checked,
        "artifacts": str(work),
        "dataset_lines": sum(1 for _ in dataset.open()),
        "compute_floor": compute_floor(dataset),
    }


def compute_floor(dataset: Path) -> int:
    """The prompt tokens no deployment can avoid computing for ``dataset`` (a mooncake trace
    whose turns carry their new input's block hashes): every turn's new input once, a block
    that several sessions share (the global and group prefixes) once in all. Replies are not
    counted: their KV exists where they were decoded, and reuse can fetch it."""
    rows = [json.loads(line) for line in dataset.open()]
    total = sum(int(row["input_length"]) for row in rows)
    seen: dict[int, int] = {}
    for row in rows:
        for block in row.get("hash_ids") or ():
            seen[block] = seen.get(block, 0) + 1
    return total - sum((count - 1) * BLOCK_SIZE for count in seen.values() if count > 1)


# ---- report ------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 0) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(mine: list[float], base: list[float]) -> str:
    """kvturn's median over the baseline's, (every run over every run); bold only where the
    whole range is below 1.0."""
    if not mine or not base:
        return "-"
    pairs = sorted(m / b for m in mine for b in base if b)
    middle = statistics.median(mine) / statistics.median(base)
    text = f"{middle:.2f} ({pairs[0]:.2f}-{pairs[-1]:.2f})"
    return f"**{text}**" if pairs[-1] < 1.0 else text


def first_tokens_by_plan(url: str) -> dict[str, tuple[float, float]]:
    """A kvturn gateway's first tokens so far by plan: (seconds in all, turns)."""
    seconds = gateway_plans(url, "kvturn_ttft_seconds_sum")
    turns = gateway_plans(url, "kvturn_ttft_seconds_count")
    return {plan: (seconds[plan], turns.get(plan, 0.0)) for plan in seconds}


def first_token_lines(by_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each kvturn mode's mean first token by plan, over all its runs (its gateway's own
    ``kvturn_ttft_seconds``: from the request's arrival to the first chunk it relayed)."""
    lines = []
    for mode, runs in by_mode.items():
        totals: dict[str, list[float]] = {}
        for run in runs:
            for plan, (seconds, turns) in (run.get("ttft_by_plan") or {}).items():
                total = totals.setdefault(plan, [0.0, 0.0])
                total[0] += seconds
                total[1] += turns
        cells = [f"{plan} {1000 * s / n:.0f} ms ({n / len(runs):.0f} a run)"
                 for plan, (s, n) in sorted(totals.items()) if n]  # fmt: skip
        if cells:
            lines.append(
                f"{mode}'s first token by plan (mean; the gateway's `kvturn_ttft_seconds`): "
                + ", ".join(cells) + "."
            )  # fmt: skip
    return lines


def _medians(by_mode: dict[str, list[dict[str, Any]]], key: str) -> list[str]:
    """``mode median`` of a run field, for each mode whose runs recorded it."""
    return [
        f"{mode} {statistics.median(values):.0f}"
        for mode, mine in by_mode.items()
        if (values := [r[key] for r in mine if r.get(key) is not None])
    ]


def report(results: list[dict[str, Any]], argv: list[str], date: str, notes: str = "") -> str:
    lines = [
        "# kvturn against the strongest baselines: AIPerf's agentic-coding workload",
        "",
        f"Command: `.venv/bin/python benchmarks/aiperf_agentic.py {' '.join(argv)}`",
        f"Date: {date} UTC; machine: {os.cpu_count()} cores shared by everything below; "
        "model: tiny (float32); AIPerf 0.13.0 (unmodified; dataset from its agentic-coding "
        "generator with `benchmarks/agentic_code.json`); vllm-router 0.1.17; every mode on the "
        "same engine processes with the same KV per engine; each mode warmed up first, then "
        "the repeats interleaved.",
        "",
        "Cells: median (min-max) over repeats. TTFT, ITL and latency in ms; job in s (AIPerf's "
        "benchmark duration). Ratios: kvturn's median over the baseline's (the range over "
        "every pair of runs); a range holding 1.00 is a tie, bold only where the whole range "
        "is below 1.0. Tokens: prompt tokens the engines computed / served from their own "
        "prefix cache / received over NIXL, a run (median).",
        *(["", notes] if notes else []),
        "",
    ]
    for result in results:
        w = result["workload"]
        runs = result["runs"]
        kv = f"{w['kv_blocks']} blocks" if w["kv_blocks"] else "2 GiB"
        lines += [
            f"## {w['name']}", "", w["what"] + ".", "",
            f"1 prefill + 1 decode, {kv} of KV each; {w['sessions']} sessions "
            f"({result['dataset_lines']} turns), {w['concurrency']} under way."
            + (f" Prompt tokens no deployment can avoid computing: {floor / 1000:.0f}k a run "
               "(every turn's new input once, the shared prefixes once; replies not counted: "
               "their KV exists where they were decoded)." if (floor := result.get(
                   "compute_floor")) else ""),
            "",
            "| mode | TTFT p50 | TTFT p90 | ITL p50 | ITL p99 | latency p50 | latency p90 | "
            "job (s) | job floor (s) | computed / cached / received | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for run in runs:
            by_mode.setdefault(run["mode"], []).append(run)

        def col(
            mode: str, key: str, by_mode: dict[str, list[dict[str, Any]]] = by_mode
        ) -> list[float]:
            return [r[key] for r in by_mode.get(mode, []) if r[key] is not None]

        floor_w = {"concurrency": w["concurrency"]}
        for mode, mine in by_mode.items():
            tokens = " / ".join(
                f"{statistics.median([r['tokens'][k] for r in mine]) / 1000:.0f}k"
                for k in ("computed", "cached", "received")
            )
            digits = {"itl_p50": 1, "itl_p99": 1}
            cells = [spread(col(mode, key), digits.get(key, 0)) for key in
                     ("ttft_p50", "ttft_p90", "itl_p50", "itl_p99", "latency_p50", "latency_p90",
                      "job_s")]  # fmt: skip
            cells.append(spread([job_floor_s(r, floor_w) for r in mine]))
            lines.append(f"| {mode} | " + " | ".join(cells) + f" | {tokens} | "
                         f"{sum(col(mode, 'errors')):.0f} |")  # fmt: skip
        kvturn = by_mode.get("kvturn", [])
        reasons: dict[str, float] = {}
        for r in kvturn:
            for k, n in r["reasons"].items():
                reasons[k] = reasons.get(k, 0.0) + n / len(kvturn)
        plans = ", ".join(f"{k} {n:.0f}" for k, n in sorted(reasons.items()))
        lines += ["", f"kvturn's turns by plan/reason a run (mean): {plans}."]
        for mode, mine in by_mode.items():
            counted = [r.get("routed") or {} for r in mine]
            keys = sorted({k for c in counted for k in c})
            if keys:
                cells = ", ".join(
                    f"{k} {statistics.mean(c.get(k, 0) for c in counted):.0f}" for k in keys
                )
                lines.append(f"{mode}'s turns a run (mean): {cells}.")
        engine_side = _medians(by_mode, "decode_prompt_tokens")
        if engine_side:
            lines.append(
                "Prompt tokens decode computed a run (median; vLLM's own step counts: "
                "`vllm:iteration_tokens_total` less its generated tokens): "
                + ", ".join(engine_side) + "."
            )  # fmt: skip
        planned = _medians(by_mode, "local_suffix_tokens")
        if planned:
            lines.append(
                "Of which decode-local turns were planned to compute (the gateway's "
                "`kvturn_local_suffix_tokens_total`; the rest is what decode's cache did not "
                "serve as planned, or recomputed after a preemption): " + ", ".join(planned) + "."
            )  # fmt: skip
        lines += first_token_lines(by_mode)
        for mode in [m for m in by_mode if m.startswith("kvturn")]:
            lines += [
                "",
                f"| {mode} over | " + " | ".join(label for label, _ in SHOWN) + " |",
                "|---|" + "---|" * len(SHOWN),
            ]
            for base in BASELINES:
                if base in by_mode:
                    cells = [ratio(col(mode, key), col(base, key)) for _, key in SHOWN]
                    lines.append(f"| {base} | " + " | ".join(cells) + " |")
            best_cells = []
            for _, key in SHOWN:
                present = [b for b in BASELINES if col(b, key)]
                if not present:
                    best_cells.append("-")
                    continue
                best = min(present, key=lambda b: statistics.median(col(b, key)))
                best_cells.append(f"{ratio(col(mode, key), col(best, key))} vs {best}")
            lines.append("| the best baseline | " + " | ".join(best_cells) + " |")
        checked = result.get("answers")
        if checked:
            lines += ["", "Answers on one seed (greedy), against vllm-pd: " + "; ".join(
                f"{mode} {c['equal']} of {c['turns']} equal" for mode, c in checked.items())
                + "."]  # fmt: skip
        routers = "; ".join(f"{m}: `{c}`" for m, c in result["routers"].items())
        lines += ["", f"Routers: {routers}.", "",
                  "AIPerf command of the first run: `" + runs[0]["command"] + "`", ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workloads", default="tight", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3000)
    parser.add_argument("--warmup-requests", type=int, default=48)
    parser.add_argument("--modes", help="comma-separated (default: the workload's own)")
    parser.add_argument(
        "--answers",
        action="store_true",
        help="after the timed runs, every mode once more on one seed",
    )
    parser.add_argument("--output", default="aiperf_agentic", help="results file stem")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--notes", help="with --render: a paragraph to keep with the results")
    args = parser.parse_args()
    json_path, md_path = RESULTS / f"{args.output}.json", RESULTS / f"{args.output}.md"
    if args.render:
        saved = json.loads(json_path.read_text())
        notes = args.notes if args.notes is not None else saved.get("notes", "")
        saved["notes"] = notes
        json_path.write_text(json.dumps(saved, indent=1))
        md_path.write_text(report(saved["results"], saved["argv"], saved["date"], notes))
        return 0
    for tool in (AIPERF_BIN, ROUTER_BIN):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: see this script's docstring for the set-up")
    date = f"{datetime.now(UTC):%Y-%m-%d %H:%M}"
    argv = sys.argv[1:]
    results = []
    for name in args.workloads.split(","):
        modes = tuple(args.modes.split(",")) if args.modes else None
        results.append(run_workload(WORKLOADS[name], args.repeats, args.seed, args.answers,
                                    args.warmup_requests, modes))  # fmt: skip
        RESULTS.mkdir(exist_ok=True)
        json_path.write_text(json.dumps({"argv": argv, "date": date, "results": results},
                                        indent=1))  # fmt: skip
        md_path.write_text(report(results, argv, date))
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
