"""A multi-turn tool-calling agent: it reads an incident log section by section, then reports.

Every turn appends the model's tool call and the tool's result, so the context grows by several
hundred tokens a turn: exactly the traffic whose history kvturn keeps from being recomputed.

    .venv/bin/python examples/log_agent.py --base-url http://127.0.0.1:8000/v1

Small models do not call tools reliably, so each reading turn names the tool in ``tool_choice``
(vLLM then constrains the output to a valid call); the last turn answers in prose.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import openai

from kvturn.client import OpenAI

SYSTEM = (
    "You are an on-call engineer. Read the incident log with the read_log tool, one section "
    "at a time, then write a short summary of what went wrong and what to do next."
)
FINAL_QUESTION = "Stop reading. In two sentences, what went wrong and what should we do next?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_log",
            "description": "Read one section of the incident log.",
            "parameters": {
                "type": "object",
                # An enum keeps a small model's constrained call short and always valid JSON.
                "properties": {"section": {"enum": list(range(1, 13)), "description": "section"}},
                "required": ["section"],
            },
        },
    }
]
_SERVICES = ("checkout", "payments", "search", "auth", "inventory", "gateway")
_EVENTS = (
    "latency p99 rose to {n} ms", "connection pool exhausted ({n} waiting)",
    "retry storm: {n} retries/s", "cache hit rate fell to {n}%", "deploy {n} rolled out",
    "GC pause of {n} ms", "disk usage at {n}%", "error rate {n} per minute",
)  # fmt: skip


def read_log(section: int, lines: int = 16) -> str:
    """A deterministic slice of a made-up incident log (the agent's tool)."""
    rng = random.Random(section)
    out = [f"== section {section} =="]
    for i in range(lines):
        event = rng.choice(_EVENTS).format(n=rng.randint(2, 990))
        out.append(f"12:{section:02d}:{i * 2:02d} {rng.choice(_SERVICES):9s} {event}")
    return "\n".join(out)


@dataclass
class TurnReport:
    turn: int
    context_tokens: int
    plan: str
    reused_tokens: int
    ttft_s: float
    ttft_without_s: float | None
    output: str


def stream_turn(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], final: bool
) -> tuple[float, dict[str, Any], Any, Any]:
    """One streamed turn: (TTFT, the assistant message, usage, raw response headers)."""
    started = time.perf_counter()
    choice: Any = "none" if final else {"type": "function", "function": {"name": "read_log"}}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=96 if final else 24, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    ttft = None
    text, arguments, name, usage = "", "", None, None
    for chunk in raw.parse():
        if ttft is None:
            ttft = time.perf_counter() - started
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                name = call.function.name or name if call.function else name
                arguments += (call.function.arguments or "") if call.function else ""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if name:
        message["tool_calls"] = [
            {"id": f"call_{len(messages)}", "type": "function",
             "function": {"name": name, "arguments": arguments or "{}"}}
        ]  # fmt: skip
    return ttft or 0.0, message, usage, raw.headers


def run(base_url: str, model: str, turns: int, compare: bool = True) -> list[TurnReport]:
    """Run the agent through kvturn; with ``compare``, replay each turn without reuse too."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=1, timeout=600)
    plain = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=1, timeout=600)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The checkout service is failing. What happened?"},
    ]
    reports = []
    with client.conversation() as conversation:
        for turn in range(1, turns + 1):
            final = turn == turns
            if final:
                messages.append({"role": "user", "content": FINAL_QUESTION})
            ttft, message, usage, headers = stream_turn(client, model, messages, final)
            without = stream_turn(plain, model, messages, final)[0] if compare else None
            reports.append(
                TurnReport(
                    turn, usage.prompt_tokens if usage else 0, headers.get("x-kvturn-plan", "?"),
                    int(headers.get("x-kvturn-reused-tokens", 0)), ttft, without,
                    message["content"] or json.dumps(message.get("tool_calls")),
                )
            )  # fmt: skip
            messages.append(message)
            if not final:
                # The tool runs: this pause is what heartbeats keep the KV alive through.
                section = turn
                calls = message.get("tool_calls") or []
                if calls:
                    try:
                        section = int(json.loads(calls[0]["function"]["arguments"])["section"])
                    except (ValueError, KeyError, TypeError):
                        section = turn
                messages.append(
                    {"role": "tool", "tool_call_id": calls[0]["id"] if calls else "none",
                     "content": read_log(section % 97 + turn)}
                )  # fmt: skip
        del conversation
    client.close()
    return reports


def print_table(reports: list[TurnReport]) -> None:
    print(
        f"{'turn':>4} {'context':>8} {'plan':>11} {'reused':>7} "
        f"{'TTFT kvturn':>12} {'TTFT recompute':>15}"
    )
    for r in reports:
        without = f"{r.ttft_without_s * 1000:12.0f} ms" if r.ttft_without_s is not None else "-"
        print(
            f"{r.turn:>4} {r.context_tokens:>8} {r.plan:>11} {r.reused_tokens:>7} "
            f"{r.ttft_s * 1000:9.0f} ms {without:>15}"
        )
    print(f"\nfinal answer: {reports[-1].output.strip()[:400]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--no-compare", action="store_true", help="skip the recompute replays")
    args = parser.parse_args()
    model = (
        args.model or openai.OpenAI(base_url=args.base_url, api_key="-").models.list().data[0].id
    )
    print_table(run(args.base_url, model, args.turns, compare=not args.no_compare))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
