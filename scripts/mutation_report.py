"""The kill rate per module of the last mutmut run (scripts/mutation.sh), checked.

Reads what ``mutmut run`` left in mutants/ (one ``<module>.meta`` per mutated module: each
mutant's exit code) for the modules ``[tool.mutmut] only_mutate`` names, prints the kill rate
of each, and fails (exit 1) when a module kills under ``--min-rate`` percent, when a mutant was
not run, or when a mutant that was not killed is not named in
benchmarks/results/mutation.md (each survivor is listed there with the reason it is
equivalent). ``--markdown`` prints the table and the survivors as that note lists them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parent.parent
NOTE = ROOT / "benchmarks" / "results" / "mutation.md"
#: A mutant some test failed on (a timeout is a loop the mutant made endless).
DETECTED = {"killed", "timeout", "caught by type check", "segfault"}


def load() -> dict[str, dict[str, str]]:
    """Module path → mutant name → status."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    results: dict[str, dict[str, str]] = {}
    for module in config["only_mutate"]:
        meta = ROOT / "mutants" / (module + ".meta")
        if not meta.exists():
            raise SystemExit(f"mutation: no results for {module} (run scripts/mutation.sh)")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        results[module] = {name: status_by_exit_code[code] for name, code in codes.items()}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-rate", type=float, default=90.0)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    results = load()
    note = NOTE.read_text() if NOTE.exists() else ""
    problems: list[str] = []
    rows = ["| module | mutants | killed | survived | kill rate |", "|---|---:|---:|---:|---:|"]
    survivors: list[tuple[str, str]] = []
    for module, statuses in results.items():
        unchecked = [n for n, s in statuses.items() if s == "not checked"]
        if unchecked:
            problems.append(f"{module}: {len(unchecked)} mutants not run (an interrupted run?)")
        tested = {n: s for n, s in statuses.items() if s not in ("skipped", "not checked")}
        killed = sum(1 for s in tested.values() if s in DETECTED)
        left = sorted((n, s) for n, s in tested.items() if s not in DETECTED)
        survivors += left
        rate = 100.0 * killed / len(tested) if tested else 100.0
        rows.append(f"| `{module}` | {len(tested)} | {killed} | {len(left)} | {rate:.1f}% |")
        if rate < args.min_rate:
            problems.append(f"{module}: kill rate {rate:.1f}% < {args.min_rate:g}%")
    unlisted = [name for name, _ in survivors if f"`{name}`" not in note]
    for name in unlisted:
        problems.append(f"survivor not listed in {NOTE.relative_to(ROOT)}: {name}")
    print("\n".join(rows))
    if args.markdown:
        print()
        for name, status in survivors:
            print(f"- `{name}` ({status})")
    elif survivors:
        print(f"\n{len(survivors)} survivors (each listed with its reason in the note):")
        for name, status in survivors:
            print(f"  {name}: {status}")
    for problem in problems:
        print(f"mutation: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
