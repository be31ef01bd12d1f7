"""The main job: local engines + gateway, then the log agent through it, TTFT per turn.

    make demo          # = .venv/bin/python examples/demo.py

Starts ``kvturn up --model smollm2`` (1 prefill + 1 decode vLLM engine on this machine's CPUs,
real NIXL transfers, the gateway on port 8000), runs ``examples/log_agent.py`` against it, prints
a per-turn table (context tokens, plan, reused tokens, TTFT with reuse beside TTFT without),
and stops everything.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import log_agent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2 (real text) or tiny")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    state_file = Path(tempfile.mkdtemp(prefix="kvturn-demo-")) / "state.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvturn.gateway.cli", "up", "--model", args.model,
         "--port", str(args.port), "--state-file", str(state_file)],
    )  # fmt: skip
    try:
        while not state_file.exists():
            if up.poll() is not None:
                print("kvturn demo: `kvturn up` failed (see above)", file=sys.stderr)
                return 1
            time.sleep(1)
        state = json.loads(state_file.read_text())
        print(f"\nkvturn demo: {args.turns}-turn tool-calling agent through {state['gateway']}\n")
        reports = log_agent.run(state["gateway"], state["model"], args.turns)
        print()
        log_agent.print_table(reports)
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


if __name__ == "__main__":
    raise SystemExit(main())
