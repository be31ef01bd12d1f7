#!/usr/bin/env bash
# Prove the reuse tests catch broken reuse: for each break in scripts/break_reuse.py (all by
# default), start a tiny-model engine pair with the broken connector, run the reuse tests
# against it, and put kvturn/connector/nixl.py back. Run it in a scratch clone (it edits the tree),
# with `make test`'s set-up done. A break that no test catches is the failure this looks for.
#   scripts/break_reuse.sh [NAME...]        results: .kvturn/break_reuse/<name>.log
set -uo pipefail
cd "$(dirname "$0")/.."
if ! git diff --quiet -- kvturn/connector/nixl.py; then
  echo "kvturn/connector/nixl.py has changes: run this in a scratch clone" >&2
  exit 2
fi
names=("$@")
[[ ${#names[@]} -eq 0 ]] && mapfile -t names < <(.venv/bin/python scripts/break_reuse.py list | cut -d: -f1)
tests=(
  tests/test_engine_pair.py::test_prefill_pulls_only_what_the_digests_prove
  tests/test_gateway_engines.py::test_streamed_conversation_reuses_previous_context
  tests/test_gateway_engines.py::test_edited_history_reuses_only_the_common_prefix
  tests/test_planner_engines.py
  tests/test_differential.py
)
out=.kvturn/break_reuse
mkdir -p "$out"
port=${KVTURN_BREAK_BASE_PORT:-28300}
uncaught=0
for name in "${names[@]}"; do
  .venv/bin/python scripts/break_reuse.py apply "$name" || exit 1
  rm -f "$out/state.json"
  .venv/bin/kvturn up --model tiny --base-port "$port" --port $((port + 90)) --kv-cache-gb 4 \
    --log-dir "$out/logs-$name" --state-file "$out/state.json" >"$out/up-$name.log" 2>&1 &
  up=$!
  for _ in $(seq 1 200); do [[ -f $out/state.json ]] && break; sleep 3; done
  KVTURN_TEST_BASE_PORT=$port KVTURN_TEST_PAIR_STATE=$out/state.json \
    .venv/bin/python -m pytest -q -p no:cacheprovider --tb=line "${tests[@]}" >"$out/$name.log" 2>&1
  status=$?
  kill -INT "$up"; wait "$up"
  git checkout -q -- kvturn/connector/nixl.py
  if [[ $status -eq 0 ]]; then
    echo "$name: NOT CAUGHT (every test passed)"; uncaught=1
  else
    echo "$name: caught by"; grep '^FAILED' "$out/$name.log" | sed 's/^/  /'
  fi
done
exit $uncaught
