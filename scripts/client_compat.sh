#!/usr/bin/env bash
# Prove kvturn.client's openai range (pyproject.toml): run tests/client (no engines) against
# the oldest and the newest supported openai release, each in a small venv of its own
# (.venv-compat-<version>: kvturn and its base dependencies, the test tools, no gateway, no
# vLLM, no adapters). A venv is made again only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# The ends of the range in pyproject.toml ("openai>=OLDEST,<4"): the oldest release it admits,
# and the newest release published when the range was last checked.
versions=(${KVTURN_COMPAT_OPENAI:-1.66.0 3.57.0})

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
# The test tools at the versions the dev extra pins, and starlette (the gateway extra's) for the
# stand-in gateway the client tests talk to.
tools=$("$python" - <<'PY'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
wanted = r"(pytest|pytest-asyncio|uvicorn|starlette)\b"
print(" ".join(d for d in extras["dev"] + extras["gateway"] if re.match(wanted, d)))
PY
)

for version in "${versions[@]}"; do
  venv=.venv-compat-$version
  stamp=$venv/.kvturn-compat-done
  fingerprint=$(cat pyproject.toml scripts/client_compat.sh | sha256sum | cut -d' ' -f1)
  if [[ ! -f $stamp || "$(cat "$stamp")" != "$fingerprint" ]]; then
    echo "client-compat: making $venv (openai==$version)"
    if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
      rm -rf "$venv"
      "$python" -m venv "$venv"
    fi
    # shellcheck disable=SC2086  # $tools is a list of requirements
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e . "openai==$version" $tools
    echo "$fingerprint" >"$stamp"
  fi
  echo "client-compat: tests/client with openai $("$venv/bin/python" -c 'import openai; print(openai.__version__)')"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/client -m "not engines"
done
