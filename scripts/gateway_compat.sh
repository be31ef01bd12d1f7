#!/usr/bin/env bash
# Prove the gateway extra's ranges (pyproject.toml): run the unit tests that exercise those
# packages (kvturn top's rich screens, the Redis table through redis-py and hiredis, the HTTP
# server's ASGI lifespan, the retry policies of tenacity, Starlette, uvloop, httptools, orjson,
# prometheus-client, python-json-logger's JSON logs) at both ends, each in a small venv of its own (.venv-compat-gateway-*:
# kvturn with the gateway extra and the test tools, no vLLM):
#   lowest: every gateway requirement at the lowest release its range admits (its ">=");
#   newest: the newest releases the ranges admit when the venv is made.
# A venv is made again only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
tests=(tests/unit/test_top.py tests/unit/test_conversation_tables.py
  tests/unit/test_http_server.py tests/unit/test_leases.py tests/unit/test_gateway_app.py
  tests/unit/test_gateway_replicas.py tests/unit/test_access_log.py)

# The gateway extra at its lower ends ("name==X" for each "name>=X"), and the dev extra's test
# tools (with what the tests import besides: hypothesis, pyte).
read -r lowest tools < <("$python" - <<'PY'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
lowest = []
for requirement in extras["gateway"]:
    match = re.match(r"([A-Za-z0-9._-]+)\s*>=\s*([^,;\s]+)", requirement)
    assert match, f"no lower end in {requirement!r}"
    lowest.append(f"{match[1]}=={match[2]}")
tools = [d for d in extras["dev"] if re.match(r"(pytest|pytest-asyncio|uvicorn|hypothesis|pyte)\b", d)]
print(",".join(lowest), ",".join(tools))
PY
)

fingerprint=$(cat pyproject.toml scripts/gateway_compat.sh | sha256sum | cut -d' ' -f1)
for end in lowest newest; do
  venv=.venv-compat-gateway-$end
  stamp=$venv/.kvturn-compat-done
  if [[ ! -f $stamp || "$(cat "$stamp")" != "$fingerprint" ]]; then
    echo "gateway-compat: making $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    pins=()
    [[ $end == lowest ]] && IFS=, read -r -a pins <<<"$lowest"
    IFS=, read -r -a tool_list <<<"$tools"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[gateway]" \
      "${pins[@]}" "${tool_list[@]}"
    echo "$fingerprint" >"$stamp"
  fi
  echo "gateway-compat ($end): $("$venv/bin/python" - <<'PY'
import re, tomllib
from importlib import metadata
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
names = [re.match(r"[A-Za-z0-9._-]+", r)[0] for r in extras["gateway"]]
print(" ".join(f"{n}=={metadata.version(n)}" for n in names))
PY
)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
done
