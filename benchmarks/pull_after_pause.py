"""A KV transfer's first step after a pause: TTFT of a turn 2 that pulls turn 1's KV (prefill
reads it from the holder decode), and of plain P/D, after the conversation paused ``--pauses``
seconds between its turns.

    .venv/bin/python benchmarks/pull_after_pause.py [--pauses 0.3 3] [--repeats 5] [--label L]

Why: on CPU, kvturn's connector paces the engine's empty steps (``engine_pacing.IdlePacer``:
10 ms apart, 250 ms after 2 s without a step that computed anything). A request whose first
steps are spent waiting on a KV transfer (a prefill pulling from decode, a decode reading
prefill's KV) schedules no tokens in them. Each row: median (min-max) over ``--repeats``
conversations (4k-token turn 1, then its reply and a 250-token tool result), each on text of
its own; ``pull-reuse`` through a gateway with decode-local off, ``recompute`` the same gateway
with a fresh ``cache_salt`` (plain P/D: decode reads the whole prompt from prefill). Prefill
runs without a prefix cache. Rows are appended to ``benchmarks/results/pull_after_pause.md``
(its header written if it has none), labelled ``--label`` (the code measured).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import uuid
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair
from turn_ttft import gateway, opening, spread_ms, ttft, turn_two

RESULTS = Path(__file__).parent / "results" / "pull_after_pause.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pauses", nargs="+", type=float, default=[0.3, 3.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        state = stack.enter_context(local_pair(kv_ttl=300))
        model = state["model"]
        stack.enter_context(
            gateway(state, 28020, "--decode-local", "off", "--implicit-conversations", "off")
        )
        client = openai.OpenAI(
            base_url="http://127.0.0.1:28020/v1", api_key="-", max_retries=0, timeout=600
        )
        ttft(client, model, opening(args.context + 600, "warm-up"), None)
        for pause in args.pauses:
            times: dict[str, list[float]] = {"pull-reuse": [], "recompute": []}
            for rep in range(args.repeats):
                for plan in ("pull-reuse", "recompute") if rep % 2 else ("recompute", "pull-reuse"):
                    salted = plan == "recompute"
                    cid = None if salted else f"pause-{uuid.uuid4().hex[:8]}"
                    seconds, _, got, _, _ = turn_two(
                        client, model, args.context, f"p{pause}-{rep}", cid,
                        salted=salted, pause_s=pause,
                    )  # fmt: skip
                    assert got.split(" (")[0] == plan, (plan, got)
                    times[plan].append(seconds)
            for plan, values in times.items():
                rows.append(f"| {args.label} | {pause:g} | {plan} | {spread_ms(values)} |")
                print(rows[-1], flush=True)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# TTFT of turn 2 after a pause, by plan\n\n"
            + (__doc__ or "").split("\n\n", 2)[2].strip().replace("\n", " ")
            + "\n\n| code | pause (s) | plan | turn-2 TTFT |\n|---|---|---|---|\n"
        )
    with RESULTS.open("a") as out:
        out.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
