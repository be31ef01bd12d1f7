"""The main job: local engines + gateway, then one of the example agents through it.

    make demo                   # = .venv/bin/python examples/demo.py --agent openai
    make demo AGENT=agents      # the OpenAI Agents SDK code agent (examples/code_agent.py)
    make demo AGENT=langgraph   # the LangGraph SQL agent (examples/sql_agent.py)

Starts ``kvturn up --model smollm2`` (1 prefill + 1 decode vLLM engine on this machine's CPUs,
real NIXL transfers, the gateway on port 8000), runs the agent against it, replays each of its
model calls recomputed (a new conversation, a fresh ``cache_salt``) and the whole run as vLLM
P/D with prefix caching serves it (prefill then decode, straight to the engines, a salt of its
own), prints a per-call table (context tokens, plan, reused tokens, TTFT through kvturn beside
both baselines, same answer or not), writes the same as a PNG
(``.kvturn/demo/ttft-<agent>.png``), and stops everything.
While it runs, ``.venv/bin/kvturn top --url http://127.0.0.1:8000`` in another terminal shows
the gateway live.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

AGENTS = {
    "openai": "plain openai SDK on kvturn.client: an on-call agent reading an incident log",
    "agents": "OpenAI Agents SDK: questions about this repository's code (list, grep, read)",
    "langgraph": "LangGraph: a SQL agent over a SQLite database of planets and moons",
}
REPO = Path(__file__).resolve().parents[1]


def run_agent(
    agent: str, base_url: str, model: str, png: Path, turns: int, engines: tuple[str, str]
) -> None:
    if agent == "openai":
        import log_agent

        outcome = log_agent.run_agent(base_url, model, turns)
        log_agent.report(outcome, base_url, True, png, engines)
    elif agent == "agents":
        import code_agent

        outcome = asyncio.run(code_agent.run_agent(base_url, model, REPO))
        code_agent.report(outcome, base_url, True, png, engines)
    else:
        import sql_agent

        sql_agent.report(sql_agent.run_agent(base_url, model), base_url, True, png, engines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agent", default="openai", choices=sorted(AGENTS))
    parser.add_argument("--model", default="smollm2", help="smollm2 (real text) or tiny")
    parser.add_argument("--turns", type=int, default=6, help="model calls of the openai agent")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--png", type=Path, default=None, help="default .kvturn/demo/ttft-AGENT.png"
    )
    args = parser.parse_args()
    png = args.png or REPO / ".kvturn" / "demo" / f"ttft-{args.agent}.png"

    state_file = Path(tempfile.mkdtemp(prefix="kvturn-demo-")) / "state.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvturn.gateway.ops.cli", "up", "--model", args.model,
         "--port", str(args.port), "--state-file", str(state_file),
         # The "vLLM P/D" replay goes to the engines as plain P/D: decode keeps none of it.
         "--no-retain-untracked"],
    )  # fmt: skip
    try:
        while not state_file.exists():
            if up.poll() is not None:
                print("kvturn demo: `kvturn up` failed (see above)", file=sys.stderr)
                return 1
            time.sleep(1)
        state = json.loads(state_file.read_text())
        print(f"\nkvturn demo: {AGENTS[args.agent]}, through {state['gateway']}")
        print(f"(live view: .venv/bin/kvturn top --url http://127.0.0.1:{args.port})\n")
        engines = (state["prefill"][0], state["decode"][0])
        run_agent(args.agent, state["gateway"], state["model"], png, args.turns, engines)
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


if __name__ == "__main__":
    raise SystemExit(main())
