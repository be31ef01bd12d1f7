"""A multi-turn tool-calling agent: it reads an incident log section by section, then reports.

Every turn appends the model's tool call and the tool's result, so the context grows by several
hundred tokens a turn: exactly the traffic whose history kvturn keeps from being recomputed.

    .venv/bin/python examples/log_agent.py --base-url http://127.0.0.1:8000/v1

Small models do not call tools reliably, so each reading turn names the tool in ``tool_choice``
(vLLM then constrains the output to a valid call) and the section is an enum; the last turn
answers in prose (``tool_choice="none"``, the tools still offered so the prompt prefix stays).

Prints one row per model call: plan, reused tokens, TTFT through kvturn beside the same call
recomputed (replayed as a new conversation with a fresh ``cache_salt``), and whether both
answers are the same.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).parent))
import turn_report

from kvturn.client import OpenAI

#: What each instance of the agent is told is failing (``incident``): the demo runs several
#: at once, each on an incident of its own, so their conversations share only the system
#: prompt and the tools, as different users' would.
INCIDENTS = ("checkout", "payments", "search", "auth", "inventory", "gateway")
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
            # Strict, with an enum: vLLM pins a forced call's arguments to the schema only for
            # strict tools, and an enum keeps a small model's call short and valid.
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"section": {"enum": list(range(1, 13)), "description": "section"}},
                "required": ["section"],
                "additionalProperties": False,
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
class Outcome:
    calls: list[turn_report.Call]
    answer: str


def run_agent(
    base_url: str,
    model: str,
    turns: int = 6,
    api_key: str = "unused",
    max_tokens: int = 24,
    answer_max_tokens: int = 96,
    recorder: turn_report.Recorder | None = None,
    incident: int = 0,
) -> Outcome:
    """Run the agent through kvturn (plain openai SDK calls on ``kvturn.client.OpenAI``);
    every model call is recorded (by ``recorder``, a new one if none is given). ``incident``
    picks the failing service (:data:`INCIDENTS`) and which log sections the tool returns;
    each run is a conversation of its own (a new id)."""
    recorder = recorder or turn_report.Recorder()
    service = INCIDENTS[incident % len(INCIDENTS)]
    client = OpenAI(
        base_url=base_url, api_key=api_key, max_retries=1, timeout=600,
        http_client=openai.DefaultHttpxClient(transport=recorder.transport()),
    )  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"The {service} service is failing. What happened?"},
    ]
    answer = ""
    with client.conversation():
        for turn in range(1, turns + 1):
            final = turn == turns
            if final:
                messages.append({"role": "user", "content": FINAL_QUESTION})
            choice: Any = (
                "none" if final else {"type": "function", "function": {"name": "read_log"}}
            )
            stream = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
                max_tokens=answer_max_tokens if final else max_tokens, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, arguments, name = "", "", None
            for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    for call in c.delta.tool_calls or []:
                        if call.function is not None:
                            name = call.function.name or name
                            arguments += call.function.arguments or ""
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if name:
                message["tool_calls"] = [
                    {"id": f"call_{turn}", "type": "function",
                     "function": {"name": name, "arguments": arguments or "{}"}}
                ]  # fmt: skip
            messages.append(message)
            if final:
                answer = text
                break
            # The tool runs: this pause is what heartbeats keep the KV alive through.
            try:
                section = int(json.loads(arguments)["section"])
            except (ValueError, KeyError, TypeError):
                section = turn
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{turn}",
                 "content": read_log(section % 97 + turn + 100 * incident)}
            )  # fmt: skip
    client.close()
    return Outcome(recorder.calls, answer)


def describe(outcome: Outcome) -> None:
    """What the agent concluded."""
    print(f"final answer: {outcome.answer.strip()[:400]}")


def report(
    outcome: Outcome,
    base_url: str,
    compare: bool,
    png: Path | None,
    engines: tuple[str, str] | None = None,
) -> list[Any]:
    """Replay the run's calls (recomputed; and as vLLM P/D with prefix caching, given the
    ``engines``: prefill URL, decode URL), print the table, draw it to ``png``."""
    rows = turn_report.replay(outcome.calls, base_url, compare=compare, engines=engines)
    turn_report.print_table(rows)
    print()
    describe(outcome)
    if png is not None:
        print(f"\nwrote {turn_report.plot(rows, png, 'openai SDK log agent: TTFT per model call')}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--no-compare", action="store_true", help="skip the recompute replays")
    parser.add_argument("--png", type=Path, default=None, help="also draw the table as a PNG")
    args = parser.parse_args()
    model = (
        args.model or openai.OpenAI(base_url=args.base_url, api_key="-").models.list().data[0].id
    )
    report(
        run_agent(args.base_url, model, args.turns), args.base_url, not args.no_compare, args.png
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
