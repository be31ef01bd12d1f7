"""CPU used by an idle 1P1D pair, with and without leased KV, and 2k/8k prefill times.

    .venv/bin/python benchmarks/idle_pair.py            # writes benchmarks/results/idle_pair.md

Measured on the engines' whole process groups (API server, engine core, worker, NIXL threads)
from /proc, over a fixed window. Targets: the idle pair under 10% of one core; an idle decode
holding 50 conversations' leases at most 2% of a core above the same decode idle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvturn.wire import PREFILL_FOR_REMOTE_DECODE as PD_PARAMS

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
    parser.add_argument("--leases", type=int, default=50, help="conversations leased on decode")
    args = parser.parse_args()

    with local_pair(kv_ttl=600, lease_s=600) as state:
        pids, model = state["pids"], state["model"]
        p_url = state["prefill"][0]
        decode_pid = pids[-1]
        time.sleep(5)  # let start-up settle
        idle = cpu_share(pids, args.window)
        idle_decode = cpu_share([decode_pid], args.window)

        # Conversations through the gateway, left open: each one's KV is leased on decode.
        for i in range(args.leases):
            body = {"model": model, "messages": prompt_of(600, f"lease{i}"), "max_tokens": 8,
                    "temperature": 0}  # fmt: skip
            headers = {"X-Conversation-Id": f"idle-{i}"}
            httpx.post(f"{state['gateway']}/chat/completions", json=body, headers=headers,
                       timeout=300).raise_for_status()  # fmt: skip
        time.sleep(5)  # past the short pacing phase
        control = state["decode_control"][0]
        auth = {"Authorization": f"Bearer {state['control_secret']}"}
        leases = httpx.get(f"{control}/kvturn/leases", headers=auth).json()
        assert leases["leases"] == args.leases, leases
        leased_decode = cpu_share([decode_pid], args.window)
        leased = cpu_share(pids, args.window)

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
        "| state | decode alone (cores) | both engines (cores) |",
        "|---|---|---|",
        f"| idle after start-up | {idle_decode:.3f} | {idle:.3f} |",
        f"| decode holding {args.leases} conversations' leases, idle | {leased_decode:.3f} "
        f"| {leased:.3f} |",
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
