#!/usr/bin/env bash
# The client-only install, as an agent developer gets it: `pip install .` (no extras) in a venv
# of its own (.venv-client-only). Checks that
#   1. it brings none of the gateway's, the engines' or the adapters' packages (the installed
#      list right after `pip install .`, and on every run the dependency closure of kvturn's
#      base requirements);
#   2. `import kvturn.client` loads no module of kvturn.gateway or kvturn.connector;
#   3. the `kvturn` command (the gateway's) says which extra to install, and exits 2;
#   4. tests/client passes against the installed package (a copy of the tests run outside the
#      repository, so that nothing imports the source tree), the tests that need the gateway or
#      an adapter left out (tests/client/conftest.py), and by their end nothing from
#      kvturn.gateway was imported.
# The venv is made again only when pyproject.toml or this script changed; kvturn itself is
# reinstalled (no dependencies) on every run, so the checks see the current code.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-client-only
stamp=$venv/.kvturn-client-only-done
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# What a client-only install must not bring: every requirement of these extras (read from
# pyproject.toml), the extras' own self-references aside.
forbidden=$("$python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
base = {re.match(r"[A-Za-z0-9._-]+", r)[0].lower() for r in project["dependencies"]}
names = set()
for extra in ("gateway", "engine", "cpu", "gpu", "agents", "langchain"):
    for requirement in project["optional-dependencies"][extra]:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)[0].lower()
        if name != "kvturn" and name not in base:
            names.add(name)
print(" ".join(sorted(names)))
PY
)

fingerprint=$(cat pyproject.toml scripts/client_only.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || "$(cat "$stamp")" != "$fingerprint" ]]; then
  echo "client-only: making $venv (pip install ., no extras)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "${pip[@]}" install .
  # 1, as installed: the venv holds nothing of those extras.
  # shellcheck disable=SC2086  # $forbidden is a list of names
  "$venv/bin/python" -P - $forbidden <<'PY'
import sys
from importlib import metadata
installed = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()}
found = sorted(installed & {n.replace("_", "-") for n in sys.argv[1:]})
assert not found, f"pip install . (no extras) installed {found}"
print(f"client-only: pip install . installed {len(installed)} distributions, none of the extras'")
PY
  # The test tools (pytest, pytest-asyncio, and uvicorn + starlette for the stand-in gateway
  # the client tests talk to) at the versions the dev extra pins; starlette as the gateway's.
  tools=$("$python" - <<'PY'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
wanted = r"(pytest|pytest-asyncio|uvicorn|starlette)\b"
print(" ".join(d for d in extras["dev"] + extras["gateway"] if re.match(wanted, d)))
PY
)
  # shellcheck disable=SC2086  # $tools is a list of requirements
  "${pip[@]}" install $tools
  echo "$fingerprint" >"$stamp"
fi
"${pip[@]}" install --no-deps --force-reinstall .

# 1 and 2, on every run: the closure of kvturn's base requirements, and what the import loads.
# shellcheck disable=SC2086
"$venv/bin/python" -P - $forbidden <<'PY'
import re, sys
from importlib import metadata

def closure(name: str, seen: set[str]) -> set[str]:
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    seen.add(key)
    try:
        requirements = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return seen
    for requirement in requirements:
        if re.search(r"\bextra\s*==", requirement.partition(";")[2]):
            continue
        closure(re.match(r"[A-Za-z0-9._-]+", requirement)[0], seen)
    return seen

brought = closure("kvturn", set())
found = sorted(brought & {n.replace("_", "-") for n in sys.argv[1:]})
assert not found, f"kvturn's base requirements bring {found}"
import kvturn.client  # noqa: E402
loaded = sorted(m for m in sys.modules if m.startswith(("kvturn.gateway", "kvturn.connector")))
assert not loaded, f"import kvturn.client loaded {loaded}"
print(f"client-only: kvturn's base requirements bring {len(brought) - 1} distributions, "
      "none of the extras'; import kvturn.client loads no gateway or connector module")
PY

# 3: the console script names the extra.
set +e
message=$("$venv/bin/kvturn" --help 2>&1)
code=$?
set -e
if [[ $code -ne 2 || $message != *"pip install 'kvturn[gateway]'"* ]]; then
  echo "client-only: kvturn --help exited $code: $message" >&2
  exit 1
fi
echo "client-only: kvturn --help says: $message"

# 4: the client's tests, from a copy outside the repository.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r tests/client "$work/client_tests"
(
  cd "$work"
  "$OLDPWD/$venv/bin/python" - <<'PY'
import sys
import pytest
code = pytest.main([
    "-q", "-p", "no:cacheprovider", "client_tests", "-m", "not engines",
    "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=session",
    "-o", "markers=engines: needs the real 1P1D vLLM pair",
])
origin = sys.modules["kvturn.client"].__file__
assert "site-packages" in origin, f"the tests imported kvturn.client from {origin}"
loaded = sorted(m for m in sys.modules if m.startswith("kvturn.gateway"))
assert not loaded, f"the client tests imported {loaded}"
print(f"client-only: tests/client ran on {origin}; no kvturn.gateway module imported")
sys.exit(code)
PY
)
