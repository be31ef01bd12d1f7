"""CPU used by an idle 1P1D pair, with and without retained KV, and 2k/8k prefill times.

    .venv/bin/python benchmarks/idle_pair.py            # writes benchmarks/results/idle_pair.md

Measured on the engines' whole process groups (API server, engine core, worker, NIXL threads)
from /proc, over a fixed window. Target for the idle pair: under 10% of one core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvturn.kv_params import PREFILL_FOR_REMOTE_DECODE as PD_PARAMS

sys.path.insert(0, str(Path(__file__).parent))
from _pair import cpu_share, local_pair

RESULTS = Path(__file__).parent / "results" / "idle_pair.md"


def prompt_of(tokens: int, salt: str) -> list[dict[str, str]]:
    # The tiny model's tokenizer is byte-level: one ASCII character is one token.
    text = (salt + " the quick brown fox jumps over the lazy dog. ") * (tokens // 45 + 1)
    return [{"role": "user", "content": text[: tokens - 20]}]


def prefill_seconds(prefill_url: str, model: str, tokens: int, salt: str) -> float:
    body = {"model": model, "messages": prompt_of(tokens, salt), "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": dict(PD_PARAMS)}  # fmt: skip
    start = time.perf_counter()
    r = httpx.post(f"{prefill_url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per CPU sample")
    parser.add_argument("--repeats", type=int, default=3, help="prefills per size")
    args = parser.parse_args()

    with local_pair(kv_ttl=120) as state:
        pids, model = state["pids"], state["model"]
        p_url, d_url = state["prefill"][0], state["decode"][0]
        time.sleep(5)  # let start-up settle
        idle = cpu_share(pids, args.window)

        # One full P/D turn: decode now retains its blocks (bidirectional mode) for the TTL.
        body = {"model": model, "messages": prompt_of(2048, "warm"), "max_tokens": 1,
                "temperature": 0, "kv_transfer_params": dict(PD_PARAMS)}  # fmt: skip
        kv = httpx.post(f"{p_url}/v1/chat/completions", json=body, timeout=300).json()
        body.update(max_tokens=16, kv_transfer_params=kv["kv_transfer_params"])
        httpx.post(f"{d_url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        time.sleep(2)
        retained = cpu_share(pids, args.window)

        prefill = {}
        for tokens in (2048, 8192):
            prefill_seconds(p_url, model, tokens, "warmup")  # first use of a shape compiles
            prefill[tokens] = statistics.median(
                prefill_seconds(p_url, model, tokens, f"run{i}") for i in range(args.repeats)
            )

    lines = [
        "# Idle 1P1D pair: CPU and prefill time",
        "",
        "Command: `.venv/bin/python benchmarks/idle_pair.py`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; machine: 2 cores; model: tiny (float32); "
        f"CPU window {args.window:.0f} s per sample; prefill: median of {args.repeats}.",
        "",
        "| state | CPU (cores, both engines together) |",
        "|---|---|",
        f"| idle after start-up | {idle:.3f} |",
        f"| holding one conversation's retained KV (decode TTL running) | {retained:.3f} |",
        "",
        "| prompt tokens | prefill time (s) |",
        "|---|---|",
        *(f"| {t} | {s:.3f} |" for t, s in prefill.items()),
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
