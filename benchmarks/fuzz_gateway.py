"""A long run of the gateway's fuzz tests (``tests/unit/test_gateway_fuzz.py``): many more
examples than CI's, and a table of every answer seen.

    .venv/bin/python benchmarks/fuzz_gateway.py [--examples 3000]

Results: ``benchmarks/results/fuzz_gateway.md`` (the run fails, and writes nothing, on any 5xx,
traceback or non-OpenAI-shaped error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "fuzz_gateway.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=3000, help="examples per property")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "KVTURN_FUZZ_EXAMPLES": str(args.examples),
               "KVTURN_FUZZ_REPORT": str(report)}  # fmt: skip
        started = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/unit/test_gateway_fuzz.py"], cwd=ROOT, env=env,
        )  # fmt: skip
        took = time.perf_counter() - started
        if run.returncode != 0:
            print("fuzz run failed: see above", file=sys.stderr)
            return run.returncode
        answers = json.loads(report.read_text())["answers"]
    total = sum(answers.values())
    five = sum(
        n for key, n in answers.items() if key.endswith(tuple(f" 5{d:02d}" for d in range(100)))
    )
    lines = [
        "# Gateway fuzzing, long run",
        "",
        f"Command: `.venv/bin/python benchmarks/fuzz_gateway.py --examples {args.examples}`  ",
        f"Date: {datetime.now():%Y-%m-%d %H:%M}; {os.cpu_count()} CPU cores; the real gateway "
        "(API keys on) on the fake engine; hypothesis properties over chat and completion "
        "bodies (every field the gateway reads, of any JSON type), turn headers (conversation "
        "and turn ids, pause headers), raw bytes with any Authorization, and the control API "
        "(any conversation id, method and body).",
        "",
        f"Requests: {total:,} in {took:.0f} s. 5xx answers: {five}. Tracebacks logged: 0. "
        "Gateway healthy afterwards: yes.",
        "",
        "| request | status | answers |",
        "|---|---|---|",
    ]
    for key in sorted(answers):
        request, status = key.rsplit(" ", 1)
        lines.append(f"| `{request}` | {status} | {answers[key]:,} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
