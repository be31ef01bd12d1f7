#!/usr/bin/env bash
# Mutation testing (issue 42): mutmut mutates the planner's arithmetic, the conversation table,
# request validation and authentication ([tool.mutmut] in pyproject.toml names the modules and
# the unit tests run), runs the unit tests that reach each mutant, then
# scripts/mutation_report.py prints the kill rate per module and fails below 90%, or when a
# surviving mutant is not listed, with why it is equivalent, in benchmarks/results/mutation.md.
#   scripts/mutation.sh            results kept in mutants/ (git-ignored): a later run retests
#                                  only the mutants of functions that changed since
#   scripts/mutation.sh --fresh    every mutant again (about 11 minutes on 2 cores)
#   MUTATION_JOBS=2 scripts/mutation.sh   mutants tested at once (default 1), each niced
# Never starts an engine: the unit tests run against tests/fake_engine.py.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
if [[ ${1:-} == --fresh ]]; then
  rm -rf mutants
fi
# mutmut re-uses results in mutants/ for functions whose code did not change; a change of the
# tests is seen through their names only, so a run after editing tests asks for --fresh.
nice -n 19 "$py" -m mutmut run --max-children "${MUTATION_JOBS:-1}"
"$py" scripts/mutation_report.py
