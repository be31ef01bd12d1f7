#!/bin/bash
# benchmarks/isolation.py on a machine with cores to spare (the device machine: 16 cores, Python
# 3.12, no vLLM, no network), so that the gateway, the fake engine and the callers do not share
# 2 cores. It needs build/device-site.tar.gz: the gateway's packages as a site folder, with the
# compiled ones (pydantic_core, orjson, httptools, uvloop, zstandard, watchfiles) as cp312
# wheels (`pip download --only-binary=:all: --python-version 3.12 ...`, unpacked). Run through
# the device tool with build/device-site.tar.gz and this script carried; results in $OUT.
python3 --version; nproc
mkdir -p /tmp/site && tar xzf build/device-site.tar.gz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import kvturn.gateway.ops.cli, uvicorn, httpx, orjson, tests.fake_engine; print('imports ok')" || exit 3
timeout 400 python3 benchmarks/isolation.py --seconds 6 --out "$OUT/isolation.md" > "$OUT/isolation.log" 2>&1
echo "rc=$?"; tail -30 "$OUT/isolation.log"
