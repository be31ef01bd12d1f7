"""Pull vs push vs push+reuse, side by side in one run, on this machine's engines.

    .venv/bin/python benchmarks/push_pull.py [--quick]

One engine pair at a time (this machine holds three engines at most): first ``kvturn up`` with
pull transfer (vLLM's NixlConnector: decode READs prefill's KV once prefill answered), then with
``--transfer push`` (NixlPushConnector under kvturn's connector: decode registers its blocks
while prefill computes, prefill WRITEs into them). Each deployment gets the same two loads,
through ``kvturn serve`` processes of its own:

* **Open-loop single turns** (the AWS sweep, scaled to 2 CPU cores): requests of INPUT tokens
  arrive as a Poisson process at RATE per second, each a fresh prompt, streamed, 32 output
  tokens; TTFT (first chunk at the client) p50/p90 and TPOT (mean gap between later chunks).
  No reuse is possible, so push+reuse is push here.
* **A multi-turn agent trace**: conversations of 4 turns, a ~2k-token first prompt, then tool
  results of ~200 tokens; TTFT per turn with reuse off (a gateway that sees no conversation:
  plain P/D every turn) and on (kvturn's default: pull-reuse or decode-local under pull,
  decode-local under push).

Every answer is greedy; the trace's answers are compared across the four configurations.
Results: benchmarks/results/push_pull.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair, server

from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results" / "push_pull.md"
#: (input tokens, request rates per second, requests per rate): rates up to about what one
#: prefill engine on one core sustains at that size.
SWEEP = ((2048, (0.5, 2.0), 12), (8192, (0.1, 0.3), 8), (16384, (0.03, 0.08), 5))
QUICK_SWEEP = ((2048, (0.5, 2.0), 6), (8192, (0.2,), 4))
OUTPUT_TOKENS = 32
TRACE_TURNS = 4


def _prompt(tokens: int, tag: str) -> str:
    text = f"Tell me everything about {tag}, slowly and in detail. " * (tokens // 40 + 1)
    return text[:tokens]


def _gateway(state: dict[str, Any], port: int, *settings: str) -> Any:
    engines = [(flag, url) for key, flag in (
        ("prefill", "--prefill"), ("prefill_control", "--prefill-control"),
        ("decode", "--decode"), ("decode_control", "--decode-control"),
    ) for url in state.get(key) or [] if url]  # fmt: skip
    command = (sys.executable, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(port),
               "--transfer", state["transfer"], *(p for pair in engines for p in pair),
               *settings)  # fmt: skip
    return server(*command, port=port, env={CONTROL_SECRET_ENV: state["control_secret"]})


def _stream(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """One streamed greedy turn: (ttft s, tpot s or None, text, plan)."""
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=OUTPUT_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, **kw,
    )  # fmt: skip
    stamps, text = [], ""
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    ttft = stamps[0] - started
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return ttft, tpot, text, raw.headers.get("x-kvturn-plan")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sweep(state: dict[str, Any], plan: Any, seed: int) -> list[dict[str, Any]]:
    rows = []
    with _gateway(state, 28050, "--implicit-conversations", "off"):
        client = openai.OpenAI(base_url="http://127.0.0.1:28050/v1", api_key="-", max_retries=0,
                               timeout=900)  # fmt: skip
        _stream(client, state["model"], [{"role": "user", "content": "warm up"}])
        for tokens, rates, count in plan:
            for rate in rates:
                rng = random.Random(seed + tokens + int(rate * 1000))
                results: list[Any] = []
                threads = []
                for i in range(count):
                    messages = [{"role": "user", "content": _prompt(tokens, uuid.uuid4().hex)}]

                    def one(m: list[dict[str, Any]] = messages, into: list[Any] = results) -> None:
                        into.append(_stream(client, state["model"], m))

                    thread = threading.Thread(target=one)
                    thread.start()
                    threads.append(thread)
                    if i < count - 1:
                        time.sleep(rng.expovariate(rate))
                for thread in threads:
                    thread.join()
                ttfts = [r[0] for r in results]
                tpots = [r[1] for r in results if r[1] is not None]
                row = {"input": tokens, "rate": rate, "n": count,
                       "ttft_p50": _pct(ttfts, 0.5), "ttft_p90": _pct(ttfts, 0.9),
                       "tpot": statistics.mean(tpots)}  # fmt: skip
                print(state["transfer"], row, flush=True)
                rows.append(row)
    return rows


def trace(state: dict[str, Any], conversations: int) -> dict[str, Any]:
    """TTFT per turn with reuse off and on; the answers, to compare across configurations."""
    out: dict[str, Any] = {}
    for reuse, port in ((False, 28051), (True, 28052)):
        settings = () if reuse else ("--implicit-conversations", "off")
        with _gateway(state, port, *settings):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                                   max_retries=0, timeout=900)  # fmt: skip
            per_turn: list[list[float]] = [[] for _ in range(TRACE_TURNS)]
            plans: list[list[str]] = [[] for _ in range(TRACE_TURNS)]
            texts = []
            for c in range(conversations):
                messages = [{"role": "user", "content": _prompt(2048, f"agent trace {c}")}]
                headers = {"X-Conversation-Id": f"trace-{uuid.uuid4().hex}"} if reuse else {}
                replies = []
                for t in range(TRACE_TURNS):
                    ttft, _, text, plan = _stream(client, state["model"], messages,
                                                  extra_headers=headers)  # fmt: skip
                    per_turn[t].append(ttft)
                    plans[t].append(plan or "?")
                    replies.append(text)
                    tool = f"tool result {t}: " + "the gauge reads 7. " * 10
                    messages = [*messages, {"role": "assistant", "content": text},
                                {"role": "user", "content": tool}]  # fmt: skip
                    time.sleep(0.3)
                texts.append(replies)
            out[f"reuse={reuse}"] = {
                "ttft": [statistics.median(v) for v in per_turn],
                "plans": [max(set(p), key=p.count) for p in plans],
                "texts": texts,
            }
            print(state["transfer"], reuse, out[f"reuse={reuse}"]["ttft"], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short sweep (smoke run)")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    plan = QUICK_SWEEP if args.quick else SWEEP
    measured: dict[str, Any] = {}
    for transfer in ("pull", "push"):
        with local_pair(transfer=transfer) as state:
            state["transfer"] = transfer
            measured[transfer] = {
                "sweep": sweep(state, plan, args.seed),
                "trace": trace(state, 1 if args.quick else args.conversations),
            }
    write(measured, args)
    return 0


def write(measured: dict[str, Any], args: argparse.Namespace) -> None:
    lines = [
        "# Pull vs push vs push+reuse",
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/push_pull.py', *sys.argv[1:]])}` "
        f"({time.strftime('%Y-%m-%d')}; tiny model, float32, 1 prefill + 1 decode on 2 CPU cores, "
        "one deployment after the other, each gateway a `kvturn serve` process).",
        "",
        "## Open-loop single turns (fresh prompts: push+reuse is push)",
        "",
        "| input | rate (req/s) | n | pull TTFT p50 / p90 | push TTFT p50 / p90 | "
        "pull TPOT | push TPOT |",
        "|---|---|---|---|---|---|---|",
    ]
    for pull, push in zip(measured["pull"]["sweep"], measured["push"]["sweep"], strict=True):
        lines.append(
            f"| {pull['input']} | {pull['rate']:g} | {pull['n']} | "
            f"{pull['ttft_p50'] * 1000:.0f} / {pull['ttft_p90'] * 1000:.0f} ms | "
            f"{push['ttft_p50'] * 1000:.0f} / {push['ttft_p90'] * 1000:.0f} ms | "
            f"{pull['tpot'] * 1000:.1f} ms | {push['tpot'] * 1000:.1f} ms |"
        )
    conversations = 1 if args.quick else args.conversations
    lines += [
        "",
        f"## Multi-turn agent trace (median TTFT per turn over {conversations} "
        "conversation(s): ~2k-token first prompt, ~200-token tool results)",
        "",
        "| turn | pull | pull+reuse | push | push+reuse |",
        "|---|---|---|---|---|",
    ]
    columns = [("pull", "reuse=False"), ("pull", "reuse=True"), ("push", "reuse=False"),
               ("push", "reuse=True")]  # fmt: skip
    for t in range(TRACE_TURNS):
        cells = []
        for transfer, key in columns:
            run = measured[transfer]["trace"][key]
            cells.append(f"{run['ttft'][t] * 1000:.0f} ms ({run['plans'][t]})")
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    texts = [measured[t]["trace"][k]["texts"] for t, k in columns]
    same = all(x == texts[0] for x in texts)
    lines += ["", f"Answers of the four trace configurations identical: **{same}**.", ""]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
