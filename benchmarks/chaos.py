"""A decode SIGKILLed under AIPerf's multi-turn load, and started again: no request may fail,
and no lease may outlive its conversation.

1 prefill + 2 decodes (``kvturn engine``'s engines, started one by one), ``kvturn serve`` in
front; AIPerf's synthetic multi-turn workload, unmodified: 18 conversations x 8 turns, 6 under
way at once, 48-token streamed replies (greedy, ``ignore_eos``), the session header set. A run
in, one decode is SIGKILLed (``--kill-after-s``) while it streams replies, and started again on
the same ports ``--restart-after-s`` later. The gateway continues every reply that was
streaming on it on another engine (:mod:`kvturn.gateway.turns.migrate`), serves every turn that
would have gone there elsewhere, and takes the decode back once it answers its health checks.

Each repeat records AIPerf's requests and errors, the killed decode's running requests at the
kill (its own ``vllm:num_requests_running``), the gateway's migrations, and, once the leases of
the last turns have had time to lapse (the gateway's ``--lease-s`` plus a margin), the blocks
each decode still holds under a lease: a lease nobody will come back for is a leak.

    .venv/bin/python benchmarks/chaos.py [--repeats 3]

Results: ``benchmarks/results/chaos.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _pair import ROOT, SESSION_HEADER, gateway_plan_reasons, server, shown
from aiperf_agentic import TOKENIZER_REPO, hf_cache
from aiperf_multiturn import AIPERF_BIN

from kvturn.gateway.ops.launch.engines import (
    EngineProcess,
    KVSettings,
    plan_specs,
    start_engines,
    wait_until_healthy,
)
from kvturn.gateway.ops.launch.local_models import ensure_model
from kvturn.wire import CONTROL_SECRET_ENV

RESULTS = Path(__file__).parent / "results"
BASE_PORT = 28100
GATEWAY_PORT = 28000
MODEL = "tiny"
#: The gateway's lease: short, so that a leak shows soon after a run.
LEASE_S = 30
WORKLOAD = [
    "--conversation-num", "18", "--num-dataset-entries", "18",
    "--conversation-turn-mean", "8", "--conversation-turn-stddev", "0",
    "--conversation-turn-delay-mean", "1000", "--conversation-turn-delay-stddev", "250",
    "--shared-system-prompt-length", "1000", "--user-context-prompt-length", "1500",
    "--isl", "300", "--isl-stddev", "0", "--osl", "48", "--osl-stddev", "0",
    "--concurrency", "6",
]  # fmt: skip


def metric(url: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def lease_stats(control_urls: list[str], secret: str) -> dict[str, dict[str, Any]]:
    """Each decode's lease figures (its ``/kvturn/leases``: ``blocks_held``, ``leases``...);
    ``{}`` where it does not answer."""
    auth = {"Authorization": f"Bearer {secret}"}
    stats: dict[str, dict[str, Any]] = {}
    for url in control_urls:
        try:
            stats[url] = dict(httpx.get(f"{url}/kvturn/leases", headers=auth, timeout=10).json())
        except (httpx.HTTPError, ValueError, TypeError):
            stats[url] = {}
    return stats


def leased_blocks(control_urls: list[str], secret: str) -> dict[str, int]:
    """Each decode's blocks under a lease (-1 where it does not answer)."""
    return {
        url: int(stats.get("blocks_held", -1))
        for url, stats in lease_stats(control_urls, secret).items()
    }


#: Set once every engine is stopped: the threads that restarted engines end then. (An engine
#: gets SIGTERM when the thread that started it ends: ``kvturn engine`` asks the kernel for
#: that, PR_SET_PDEATHSIG, so that a crashed launcher leaves no engine behind.)
THE_END = threading.Event()


def kill_and_restart(
    victim: list[EngineProcess],
    log_dir: Path,
    args: argparse.Namespace,
    record: dict[str, Any],
    back: threading.Event,
) -> None:
    """SIGKILL the decode ``--kill-after-s`` in, once it streams replies; start it again
    ``--restart-after-s`` later; note its running requests and when it answered again."""
    time.sleep(args.kill_after_s)
    engine = victim[0]
    deadline = time.monotonic() + 30
    running = 0.0
    while time.monotonic() < deadline:
        running = metric(engine.spec.url, "vllm:num_requests_running")
        if running > 0:
            break
        time.sleep(0.05)
    record["running_at_kill"] = running
    assert engine.pid is not None
    os.killpg(engine.pid, signal.SIGKILL)
    killed = time.monotonic()
    engine.stop(grace_s=1)  # reaps it
    restart(victim, log_dir, args, record, back, killed)


def restart(
    victim: list[EngineProcess],
    log_dir: Path,
    args: argparse.Namespace,
    record: dict[str, Any],
    back: threading.Event,
    stopped: float,
) -> None:
    """Start the stopped decode again ``--restart-after-s`` after ``stopped``; note when it
    answered; then keep this thread (its parent, for PR_SET_PDEATHSIG) until the end."""
    time.sleep(args.restart_after_s)
    restarted = EngineProcess(
        victim[0].spec, log_dir / f"decode-restart-{time.time():.0f}.log"
    ).start()
    victim[0] = restarted
    wait_until_healthy([restarted], timeout_s=600)
    record["healthy_after_restart_s"] = round(time.monotonic() - stopped - args.restart_after_s, 1)
    back.set()
    THE_END.wait()


def drain_and_stop(
    victim: list[EngineProcess],
    log_dir: Path,
    args: argparse.Namespace,
    record: dict[str, Any],
    back: threading.Event,
    gateway: str,
    secret: str,
) -> None:
    """``--drain``: ask the decode to drain ``--kill-after-s`` in (a Kubernetes ``preStop``),
    SIGTERM it ``--grace-s`` later (vLLM aborts what it still runs), start it again
    ``--restart-after-s`` after that. Note the leases it held when asked and the gateway's
    plan reasons from then on."""
    time.sleep(args.kill_after_s)
    engine = victim[0]
    control = f"http://127.0.0.1:{engine.spec.control_port}"
    held = lease_stats([control], secret)[control]
    record["leases_at_drain"] = int(held.get("blocks_held", -1))
    record["conversations_at_drain"] = int(held.get("leases", -1))
    record["running_at_kill"] = metric(engine.spec.url, "vllm:num_requests_running")
    record["reasons_before"] = gateway_plan_reasons(gateway)
    record["handoffs_before"] = handoffs(gateway)
    auth = {"Authorization": f"Bearer {secret}"}
    httpx.post(f"{control}/kvturn/drain", headers=auth, timeout=10).raise_for_status()
    time.sleep(args.grace_s)
    record["running_at_stop"] = metric(engine.spec.url, "vllm:num_requests_running")
    engine.stop(grace_s=15)
    restart(victim, log_dir, args, record, back, time.monotonic())


def handoffs(gateway: str) -> dict[str, float]:
    """The gateway's drain handoffs so far, by outcome (pulled, cached, lost)."""
    return {
        outcome: metric(gateway, "kvturn_drain_handoffs_total", f'outcome="{outcome}"')
        for outcome in ("pulled", "cached", "lost")
    }


def run(
    repeat: int, args: argparse.Namespace, gateway: str, decodes: list[list[EngineProcess]],
    controls: list[str], secret: str, work: Path,
) -> dict[str, Any]:  # fmt: skip
    out = work / f"run-{repeat}"
    command = [
        str(AIPERF_BIN), "profile", "--model", MODEL, "--tokenizer", TOKENIZER_REPO,
        "--url", gateway, "--endpoint-type", "chat", "--streaming",
        "--random-seed", str(4000 + repeat), "--extra-inputs", "temperature:0",
        "--extra-inputs", "ignore_eos:true", "--session-header", SESSION_HEADER,
        "--use-server-token-count", "--no-server-metrics", "--ui-type", "none",
        "--artifact-dir", str(out), *WORKLOAD,
    ]  # fmt: skip
    before = {
        outcome: metric(gateway, "kvturn_stream_migrations_total", f'outcome="{outcome}"')
        for outcome in ("continued", "failed", "impossible")
    }
    victim = decodes[repeat % len(decodes)]
    record: dict[str, Any] = {"repeat": repeat, "killed": victim[0].spec.url}
    back = threading.Event()
    if args.drain:
        chaos = threading.Thread(
            target=drain_and_stop, args=(victim, work, args, record, back, gateway, secret)
        )
    else:
        chaos = threading.Thread(target=kill_and_restart, args=(victim, work, args, record, back))
    env = {**os.environ, **hf_cache(Path(args.model_path), work / "hf")}
    started = time.monotonic()
    chaos.start()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=3600, env=env)
    record["aiperf_s"] = round(time.monotonic() - started, 1)
    back.wait()
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    data = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    records = data.get("records", data)
    record["requests"] = records.get("request_count", {}).get("avg")
    record["errors"] = (records.get("error_request_count") or {}).get("avg", 0.0)
    record["error_summary"] = data.get("error_summary") or []
    record["migrations"] = {
        outcome: metric(gateway, "kvturn_stream_migrations_total", f'outcome="{outcome}"')
        - before[outcome]
        for outcome in before
    }
    if args.drain:
        record["handoffs"] = {
            k: v - record["handoffs_before"][k] for k, v in handoffs(gateway).items()
        }
        after = gateway_plan_reasons(gateway)
        record["reasons_since_drain"] = {
            k: v - record["reasons_before"].get(k, 0.0)
            for k, v in after.items()
            if v - record["reasons_before"].get(k, 0.0)
        }
    # The last turns' leases lapse LEASE_S after their replies; a margin for the sweep.
    time.sleep(LEASE_S + 15)
    record["leased_blocks_after"] = leased_blocks(controls, secret)
    record["command"] = shown(tuple(command))
    print(json.dumps(record), flush=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-after-s", type=float, default=25.0)
    parser.add_argument("--restart-after-s", type=float, default=30.0)
    parser.add_argument(
        "--drain", action="store_true",
        help="drain the decode (its control server's /kvturn/drain) instead of killing it, "
        "then SIGTERM it --grace-s later",
    )  # fmt: skip
    parser.add_argument("--grace-s", type=float, default=20.0)
    args = parser.parse_args()
    for tool in (AIPERF_BIN,):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: see aiperf_agentic.py's docstring")
    secret = os.environ.setdefault(CONTROL_SECRET_ENV, secrets.token_urlsafe(32))
    model = ensure_model(MODEL)
    args.model_path = str(model)
    work = Path(tempfile.mkdtemp(prefix="kvturn-chaos-"))
    specs = plan_specs(
        model, 1, 2, base_port=BASE_PORT, kv=KVSettings(), served_model_name=MODEL, kv_cache_gb=1
    )
    for port in (GATEWAY_PORT, *(p for spec in specs for p in (spec.port, spec.control_port) if p)):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            raise SystemExit(f"port {port} is taken (a process left by an interrupted run?)")
    print(f"== starting 1 prefill + 2 decodes (logs in {work})", flush=True)
    deployment = start_engines(specs, work)
    decodes = [[engine] for engine in deployment.decode]
    controls = [f"http://127.0.0.1:{e.spec.control_port}" for e in deployment.decode]
    serve = [
        sys.executable, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(GATEWAY_PORT),
        "--lease-s", str(LEASE_S),
        *[a for e in deployment.prefill for a in ("--prefill", e.spec.url)],
        *[a for e in deployment.decode for a in ("--decode", e.spec.url)],
        *[a for url in controls for a in ("--decode-control", url)],
    ]  # fmt: skip
    gateway = f"http://127.0.0.1:{GATEWAY_PORT}"
    records = []
    try:
        with server(*serve, port=GATEWAY_PORT):
            for repeat in range(args.repeats):
                print(f"== repeat {repeat + 1}", flush=True)
                records.append(run(repeat, args, gateway, decodes, controls, secret, work))
    finally:
        for engine in [*deployment.prefill, *(d[0] for d in decodes)]:
            engine.stop()
        THE_END.set()
    date = f"{datetime.now(UTC):%Y-%m-%d %H:%M}"
    stem = "chaos_drain" if args.drain else "chaos"
    (RESULTS / f"{stem}.json").write_text(
        json.dumps(
            {"date": date, "argv": sys.argv[1:], "gateway": shown(tuple(serve)), "runs": records},
            indent=1,
        )
    )
    lines = report(records, args, date, shown(tuple(serve)))
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def report(
    records: list[dict[str, Any]], args: argparse.Namespace, date: str, serve: str
) -> list[str]:
    what = (
        f"{args.kill_after_s:g} s into each run a decode (the two in turn) is asked to drain "
        f"(`POST /kvturn/drain` on its control server, as the chart's preStop does), SIGTERMed "
        f"{args.grace_s:g} s later (vLLM aborts what it still runs), and started again "
        f"{args.restart_after_s:g} s after that."
        if args.drain
        else f"{args.kill_after_s:g} s into each run a decode (the two in turn) is SIGKILLed "
        f"while it streams, and started again {args.restart_after_s:g} s later on the same ports."
    )
    title = "drained" if args.drain else "SIGKILLed"
    lines = [
        f"# A decode {title} under AIPerf's multi-turn load, and started again",
        "",
        f"Command: `.venv/bin/python benchmarks/chaos.py {' '.join(sys.argv[1:])}`",
        f"Date: {date}; machine: 2 cores; model: tiny; AIPerf 0.13.0 (unmodified).",
        "",
        "1 prefill + 2 decodes (1 GiB of KV each), `kvturn serve` in front (its lease "
        f"{LEASE_S} s); AIPerf's synthetic multi-turn: 18 conversations x 8 turns, 6 at once, "
        f"48-token streamed greedy replies. {what}",
        "",
    ]
    if args.drain:
        lines += [
            "Next turns of the conversations the drained decode held, as the gateway counted "
            "them (`kvturn_drain_handoffs_total`): pulled from it while it answered, found in "
            "prefill's prefix cache already (nothing to pull: reused all the same), or lost "
            "(it had stopped, or their KV was gone: recomputed). Conversations leased at the "
            "drain: the decode's live leases then (its `/kvturn/leases`); one that has no next "
            "turn (AIPerf's conversation was over) is none of these.",
            "",
            "| repeat | requests | failed | replies running at the drain / at the SIGTERM | "
            "continued elsewhere | leased at the drain: conversations (blocks) | next turns "
            "pulled | cached | lost | reused | healthy again (s after restart) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in records:
            h = r["handoffs"]
            reused = h["pulled"] + h["cached"]
            share = f"{reused / (reused + h['lost']):.0%}" if reused + h["lost"] else "-"
            lines.append(
                f"| {r['repeat'] + 1} | {r['requests']:.0f} | {r['errors']:.0f} | "
                f"{r['running_at_kill']:.0f} / {r['running_at_stop']:.0f} | "
                f"{r['migrations']['continued']:.0f} | "
                f"{r.get('conversations_at_drain', '-')} ({r['leases_at_drain']}) | "
                f"{h['pulled']:.0f} | {h['cached']:.0f} | {h['lost']:.0f} | {share} | "
                f"{r['healthy_after_restart_s']} |"
            )
    else:
        lines += [
            "| repeat | requests | failed | replies streaming on the decode at the kill | "
            "continued elsewhere | could not | healthy again (s after restart) | "
            f"leased blocks {LEASE_S + 15} s after the run |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in records:
            m = r["migrations"]
            lines.append(
                f"| {r['repeat'] + 1} | {r['requests']:.0f} | {r['errors']:.0f} | "
                f"{r['running_at_kill']:.0f} | {m['continued']:.0f} | "
                f"{m['failed'] + m['impossible']:.0f} | {r['healthy_after_restart_s']} | "
                f"{sum(r['leased_blocks_after'].values())} |"
            )
    lines += ["", BASELINE, "", f"Gateway: `{serve}`", "", f"AIPerf: `{records[0]['command']}`"]
    return lines


#: Why this result has no baseline column.
BASELINE = (
    "No baseline mode: this is not a speed claim but kvturn's own fault handling, and what it "
    "counts has no counterpart behind vllm-router (vLLM P/D with prefix caching, the strongest "
    "baseline elsewhere): vllm-router continues no stream on another engine and holds no "
    "leases, so there is nothing of it to continue or to leak. How many of its requests a "
    "killed decode would fail was not measured here."
)


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
