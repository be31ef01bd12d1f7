"""Inter-token latency by decode load, from the AIPerf runs of ``aiperf_agentic.py``.

AIPerf's inter-token latency is a per-request figure: (request latency - TTFT) / (output
tokens - 1), the reply's mean gap; its p99 over a 228-turn run is the second or third slowest
reply. On one CPU decode the mean gap grows with how many replies decode at once, so a mode
that answers sooner (more sessions decoding at any moment) shows a higher ITL even where no
step of its decode is slower. This reads every request's decode window (first token to last)
from AIPerf's per-record export and, for each reply, the time-weighted mean number of replies
decoding during it (itself included): ITL by that load, per mode, with the reply's largest
single gap where AIPerf recorded the chunks' gaps.

    .venv/bin/python benchmarks/itl_by_load.py /tmp/kvturn-agentic-tight-XXXX \\
        --output aiperf_agentic_itl_by_load

The directory is the run's artifacts (``aiperf_agentic.py`` prints it): ``<mode>-<repeat>/``
each with AIPerf's ``profile_export.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
#: Load bins (replies decoding at once, the reply itself included).
BINS = ((1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 9))
#: A gap between two chunks of a reply this long is a stall (ms).
STALL_MS = 500.0


@dataclass(frozen=True, slots=True)
class Reply:
    first_token_s: float
    end_s: float
    itl_ms: float
    #: The longest gap between two of its chunks (ms), if AIPerf recorded them.
    worst_gap_ms: float | None
    #: Its gaps (after the first chunk) longer than :data:`STALL_MS`.
    stalls: int


def replies(export: Path) -> list[Reply]:
    found = []
    for line in export.open():
        record = json.loads(line)
        metrics, meta = record["metrics"], record["metadata"]
        if "inter_token_latency" not in metrics:
            continue
        start = meta["request_start_ns"] / 1e9
        gaps = (metrics.get("inter_chunk_latency") or {}).get("value") or []
        found.append(
            Reply(
                start + metrics["time_to_first_token"]["value"] / 1e3,
                start + metrics["request_latency"]["value"] / 1e3,
                metrics["inter_token_latency"]["value"],
                max(gaps[1:]) if len(gaps) > 1 else None,
                sum(1 for gap in gaps[1:] if gap > STALL_MS),
            )
        )
    return found


def loads(run: list[Reply]) -> list[float]:
    """For each reply, the mean number of replies decoding during its decode window."""
    out = []
    for reply in run:
        span = reply.end_s - reply.first_token_s
        if span <= 0:
            out.append(1.0)
            continue
        overlap = sum(
            max(0.0, min(reply.end_s, other.end_s) - max(reply.first_token_s, other.first_token_s))
            for other in run
        )
        out.append(overlap / span)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("--output", help="results file stem (default: print only)")
    parser.add_argument("--notes", default="", help="a paragraph to keep with the results")
    args = parser.parse_args()
    by_mode: dict[str, list[tuple[float, Reply]]] = {}
    runs: dict[str, int] = {}
    for run_dir in sorted(args.artifacts.iterdir()):
        export = run_dir / "profile_export.jsonl"
        mode, _, repeat = run_dir.name.rpartition("-")
        if not export.exists() or not repeat.isdigit():
            continue  # warm-ups and answers are not timed runs
        run = replies(export)
        runs[mode] = runs.get(mode, 0) + 1
        by_mode.setdefault(mode, []).extend(zip(loads(run), run, strict=True))
    lines = [
        "# Inter-token latency by decode load",
        "",
        f"Command: `.venv/bin/python benchmarks/itl_by_load.py {args.artifacts}`",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "Modes as `aiperf_agentic.py` names them, all in the same runs on the same engines: "
        "`vllm-pd` is the strongest baseline a user runs today, vLLM P/D with prefix caching on "
        "every engine behind vllm-router (`consistent_hash` on `X-Session-ID`); "
        "`decode-affinity` the router that sends a short-suffix turn to the decode holding it "
        "(llm-d's and Dynamo's behaviour); `kvturn`, `kvturn-no-budget` kvturn's gateway.",
        "",
        "Load: replies decoding at once during a reply (time-weighted mean, itself included). "
        "ITL: AIPerf's, a reply's mean gap (ms). Worst gap: a reply's longest gap between two "
        "chunks after its first (ms).",
        "",
        f"| mode | replies | mean load | ITL p50 | ITL p99 | worst gap p50 | worst gap p99 | "
        f"gaps over {STALL_MS / 1000:g} s, a run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, rows in by_mode.items():
        itl = [r.itl_ms for _, r in rows]
        worst = [r.worst_gap_ms for _, r in rows if r.worst_gap_ms is not None]
        lines.append(
            f"| {mode} | {len(rows)} | {statistics.fmean(x for x, _ in rows):.2f} | "
            f"{pct(itl, 0.5):.1f} | {pct(itl, 0.99):.1f} | "
            f"{pct(worst, 0.5):.0f} | {pct(worst, 0.99):.0f} | "
            f"{sum(r.stalls for _, r in rows) / runs[mode]:.0f} |"
        )
    lines += ["", "By load (ITL p50 / p90 / max, replies):", ""]
    header = "| mode | " + " | ".join(f"load {lo}-{hi}" for lo, hi in BINS) + " |"
    lines += [header, "|---" * (len(BINS) + 1) + "|"]
    for mode, rows in by_mode.items():
        cells = []
        for lo, hi in BINS:
            itl = [r.itl_ms for load, r in rows if lo <= load < hi]
            cells.append(
                f"{pct(itl, 0.5):.0f} / {pct(itl, 0.9):.0f} / {max(itl):.0f} ({len(itl)})"
                if len(itl) >= 5
                else "-"
            )
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    if args.notes:
        lines += ["", args.notes]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        (RESULTS / f"{args.output}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
