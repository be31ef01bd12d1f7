"""The main job: local engines + gateway, then one of the example agents through it, compared
fairly with vLLM P/D with prefix caching.

    make demo                   # = .venv/bin/python examples/demo.py --agent openai
    make demo AGENT=agents      # the OpenAI Agents SDK code agent (examples/code_agent.py)
    make demo AGENT=langgraph   # the LangGraph SQL agent (examples/sql_agent.py)

Starts ``kvturn up --model smollm2`` (1 prefill + 1 decode vLLM engine on this machine's CPUs,
real NIXL transfers, the gateway on port 8000), then (``examples/demo_compare.py``):

- a warm-up, discarded: the agents once through kvturn and their calls once as plain P/D, so
  that both modes are timed on engines that have served their first requests;
- two rounds in alternating order: kvturn then vLLM P/D, then vLLM P/D then kvturn. A kvturn
  run is ``--agents`` instances of the agent at once, each its own conversation; a vLLM P/D run
  replays the latest kvturn run's calls as plain P/D with prefix caching would serve them
  (prefill, then decode, straight to the engines), one stream per agent, all at once: the same
  shape, decode's streams shared alike. Every run has a ``cache_salt`` of its own, so none
  finds another's prompts in a prefix cache;
- the first measured kvturn run's calls recomputed (each a new conversation with a fresh
  ``cache_salt``), in the same shape.

It prints the agent's answers, a per-call table (context tokens, kvturn's plans, reused tokens,
median TTFT through kvturn, as vLLM P/D and recomputed, kvturn over vLLM P/D with "slower"
where kvturn lost, same answer or not), calls 2..N per round with its order and the median of
the rounds, writes the per-call medians as a PNG (``.kvturn/demo/ttft-<agent>.png``), and stops
everything. While it runs, ``.venv/bin/kvturn top --url http://127.0.0.1:8000`` in another
terminal shows the gateway live.

Several agents at once is the default for the ``openai`` agent only (3; ``--agents``): the
Agents SDK and LangGraph agents write longer replies and run one at a time by default, to keep
the demo within a few minutes on 2 CPU cores; their runs are still warm and alternating.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import demo_compare
import turn_report

AGENTS = {
    "openai": "plain openai SDK on kvturn.client: an on-call agent reading an incident log",
    "agents": "OpenAI Agents SDK: questions about this repository's code (list, grep, read)",
    "langgraph": "LangGraph: a SQL agent over a SQLite database of planets and moons",
}
#: How many instances of each agent run at once by default.
CONCURRENT = {"openai": 3, "agents": 1, "langgraph": 1}
TITLES = {
    "openai": "openai SDK log agent",
    "agents": "Agents SDK code agent",
    "langgraph": "LangGraph SQL agent",
}
REPO = Path(__file__).resolve().parents[1]


def agent_runner(
    agent: str, base_url: str, model: str, turns: int
) -> tuple[demo_compare.AgentFn, Callable[[Any], None]]:
    """Runs one instance of ``agent`` (its index, its recorder) and prints its outcome."""
    if agent == "openai":
        import log_agent

        def run_log(i: int, recorder: turn_report.Recorder) -> Any:
            return log_agent.run_agent(base_url, model, turns, recorder=recorder, incident=i)

        return run_log, log_agent.describe
    if agent == "agents":
        import code_agent

        def run_code(i: int, recorder: turn_report.Recorder) -> Any:
            return asyncio.run(code_agent.run_agent(base_url, model, REPO, recorder=recorder))

        return run_code, code_agent.describe
    import sql_agent

    def run_sql(i: int, recorder: turn_report.Recorder) -> Any:
        return sql_agent.run_agent(base_url, model, recorder=recorder)

    return run_sql, sql_agent.describe


def run_demo(
    agent: str,
    base_url: str,
    model: str,
    png: Path,
    turns: int,
    engines: tuple[str, str],
    agents: int,
    rounds: int,
) -> demo_compare.Comparison:
    run_agent, describe = agent_runner(agent, base_url, model, turns)
    print(
        f"warm-up, then {rounds} rounds in alternating order, {agents} "
        f"agent{'s' if agents > 1 else ''} at once:"
    )
    comparison = demo_compare.measure(
        run_agent,
        demo_compare.pd_sender(engines),
        demo_compare.recompute_sender(base_url),
        agents=agents,
        rounds=rounds,
    )
    first = comparison.first_kvturn
    print(f"\nagent 1 of {agents}, round 1, through kvturn:")
    describe(first.outcomes[0])
    print()
    demo_compare.print_comparison(comparison)
    title = (
        f"{TITLES[agent]}: median TTFT per model call, {agents} at once, "
        f"{rounds} alternating rounds, warm engines"
    )
    print(f"\nwrote {turn_report.plot(demo_compare.median_rows(comparison), png, title)}")
    return comparison


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agent", default="openai", choices=sorted(AGENTS))
    parser.add_argument("--model", default="smollm2", help="smollm2 (real text) or tiny")
    parser.add_argument("--turns", type=int, default=6, help="model calls of the openai agent")
    parser.add_argument(
        "--agents", type=int, default=None,
        help="instances of the agent at once (default: 3 for openai, else 1)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=2, help="measured rounds, in alternating order (2)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--png", type=Path, default=None, help="default .kvturn/demo/ttft-AGENT.png"
    )
    args = parser.parse_args()
    if args.rounds < 1 or (args.agents is not None and args.agents < 1):
        parser.error("--rounds and --agents must be at least 1")
    agents = args.agents or CONCURRENT[args.agent]
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
        run_demo(
            args.agent, state["gateway"], state["model"], png, args.turns, engines,
            agents, args.rounds,
        )  # fmt: skip
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


if __name__ == "__main__":
    raise SystemExit(main())
