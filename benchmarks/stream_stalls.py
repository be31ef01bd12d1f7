"""What each kind of turn costs a stream already decoding on the same decode engine.

One reply streams on the decode (1,500 tokens, greedy, ``ignore_eos``) while other
conversations' turns run back to back beside it, one kind per stream:

* ``none``: nothing else (the stream's own pace);
* ``decode-local``: turn 2 of a conversation whose history (``--context`` tokens) the decode
  holds, ``--suffix`` new tokens computed by the decode in its batch (kvturn's default plan);
* ``pull-reuse``: the same turn through a gateway with decode-local off: prefill reads the
  history from the decode, computes the suffix, and decode reads the whole prompt back;
* ``pd``: a new conversation's first turn (``--context`` tokens): prefill computes it, the
  decode reads it (plain P/D, what every mode does for a prompt nobody holds);
* ``tokenize``: the decode's API server counting a chat of ``--context`` tokens (``/tokenize``:
  the gateway asks an idle prefill first, the holder when none is idle).

The gaps between the stream's chunks while those turns ran are the cost: median, p99, the
longest, and how many exceeded 100 ms. Every turn's history is sent (turn 1) before the
stream starts, so only the turns of the kind measured run beside it.

    .venv/bin/python benchmarks/stream_stalls.py [--repeats 3]

Results: ``benchmarks/results/stream_stalls.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _pair import local_pair, server

from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results"
#: Where the strongest baseline stands in this result.
BASELINE = (
    "Baselines: what vLLM P/D with prefix caching behind vllm-router does to a decode's "
    "streams is the `pd` row: its every turn is prefill's compute and the decode's read of the "
    "prompt (the router is not on the decode's path, and prefill's prefix cache changes what "
    "prefill computes, not what the decode does). What llm-d's and Dynamo's routers do on a "
    "short-suffix turn is the `decode-local` row. No ratio is claimed: this measures each kind "
    "of turn, not a deployment."
)
KINDS = ("none", "decode-local", "pull-reuse", "pd", "tokenize")
NO_LOCAL_PORT = 28060
STREAM_TOKENS = 1500
#: The stream's first chunks are its own prefill's: gaps are counted after these.
SKIP_CHUNKS = 20


def text(tokens: int, seed: str) -> str:
    """About ``tokens`` tokens of the tiny byte-level model, unique to ``seed``."""
    words = (seed + " " + uuid.uuid4().hex + " ") * (tokens // 40 + 1)
    return words[:tokens]


def stream_gaps(
    decode: str, model: str, until: threading.Event, started: threading.Event
) -> list[float]:
    """Stream a reply from the decode alone; the gaps (ms) between its chunks once started."""
    body = {
        "model": model, "messages": [{"role": "user", "content": text(800, "stream")}],
        "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    gaps: list[float] = []
    last = None
    chunks = 0
    with httpx.stream("POST", decode + "/v1/chat/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            chunks += 1
            if chunks == SKIP_CHUNKS:
                started.set()
            elif chunks > SKIP_CHUNKS and last is not None and not until.is_set():
                gaps.append((now - last) * 1000)
            last = now
    return gaps


def turn(
    gateway: str, model: str, messages: list[dict[str, Any]], conversation: str
) -> dict[str, Any]:
    response = httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={"X-Conversation-Id": conversation}, timeout=600,
    )  # fmt: skip
    response.raise_for_status()
    return {"reply": response.json()["choices"][0]["message"]["content"],
            "plan": response.headers.get("x-kvturn-plan")}  # fmt: skip


def measure(kind: str, state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    model, decode = state["model"], state["decode"][0]
    gateway = str(state["gateway"]).removesuffix("/v1")
    via = f"http://127.0.0.1:{NO_LOCAL_PORT}" if kind == "pull-reuse" else gateway
    prepared: list[tuple[str, list[dict[str, Any]]]] = []
    for i in range(args.turns):
        conversation = f"{kind}-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": text(args.context, f"{kind} {i}")}]
        if kind in ("decode-local", "pull-reuse"):
            first = turn(via, model, messages, conversation)
            messages = [*messages, {"role": "assistant", "content": first["reply"]},
                        {"role": "tool", "content": text(args.suffix, f"tool {i}")}]  # fmt: skip
        prepared.append((conversation, messages))
    time.sleep(2)  # turn 1s' replies settled
    until, started = threading.Event(), threading.Event()
    result: dict[str, Any] = {}
    background = threading.Thread(
        target=lambda: result.setdefault("gaps", stream_gaps(decode, model, until, started))
    )
    background.start()
    started.wait(600)
    plans: list[str | None] = []
    begun = time.perf_counter()
    for conversation, messages in prepared:
        if kind == "none":
            time.sleep(1.0)
        elif kind == "tokenize":
            httpx.post(
                decode + "/tokenize", json={"model": model, "messages": messages}, timeout=60
            )
            time.sleep(0.2)
        else:
            plans.append(turn(via, model, messages, conversation)["plan"])
    ran_s = time.perf_counter() - begun
    until.set()
    background.join()
    gaps = result["gaps"]
    return {
        "kind": kind, "plans": plans, "ops_s": ran_s, "gaps": len(gaps),
        "median_ms": statistics.median(gaps), "p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))],
        "max_ms": max(gaps), "over_100ms": sum(1 for g in gaps if g > 100),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6, help="turns beside each stream")
    parser.add_argument("--context", type=int, default=5000)
    parser.add_argument("--suffix", type=int, default=300)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with local_pair(gateway_port=28000, kv_cache_gb=2, lease_s=300) as state:
        no_local = [
            sys.executable, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(NO_LOCAL_PORT),
            "--decode-local", "off", "--lease-s", "300",
            "--prefill", state["prefill"][0], "--decode", state["decode"][0],
            "--decode-control", state["decode_control"][0],
        ]  # fmt: skip
        with server(
            *no_local, port=NO_LOCAL_PORT, env={CONTROL_SECRET_ENV: state["control_secret"]}
        ):
            measure("pd", state, args)  # warm-up, discarded
            for repeat in range(args.repeats):
                for kind in KINDS if repeat % 2 == 0 else tuple(reversed(KINDS)):
                    row = measure(kind, state, args)
                    row["repeat"] = repeat
                    rows.append(row)
                    print(row, flush=True)
    lines = [
        "# What each kind of turn costs a stream decoding on the same decode",
        "",
        f"Command: `.venv/bin/python benchmarks/stream_stalls.py {' '.join(sys.argv[1:])}`",
        "",
        f"A {STREAM_TOKENS}-token greedy stream on the decode (tiny model, one core an engine); "
        f"beside it, {args.turns} turns of one kind back to back ({args.context}-token "
        f"histories, {args.suffix}-token suffixes). Gaps between the stream's chunks while they "
        f"ran; median over {args.repeats} repeats (min-max).",
        "",
        "| beside the stream | gap median (ms) | gap p99 (ms) | longest gap (ms) "
        "| gaps over 100 ms | turns took (s) | plans |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]

        def cell(key: str, digits: int = 0, mine: list[dict[str, Any]] = mine) -> str:
            values = [r[key] for r in mine]
            low, mid, high = min(values), statistics.median(values), max(values)
            return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

        plans = sorted({p for r in mine for p in r["plans"] if p})
        lines.append(
            f"| {kind} | {cell('median_ms', 1)} | {cell('p99_ms')} | {cell('max_ms')} | "
            f"{cell('over_100ms')} | {cell('ops_s', 1)} | {', '.join(plans) or '-'} |"
        )
    lines += ["", BASELINE]
    (RESULTS / "stream_stalls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
