"""Tenant A's service while another caller attacks (issue #39): no caller can slow, block or
skew service for another.

    .venv/bin/python benchmarks/isolation.py                   # isolation.md
    .venv/bin/python benchmarks/isolation.py --attacker idle   # isolation_idle.md

A gateway (``kvturn serve``, its own process) with two tenants' keys, in front of the test
suite's fake engine (``tests/fake_engine.py``: replies at once, so what is measured is the
gateway). Tenant A runs turns from a few threads, one conversation each, for a fixed time; the
same, while tenant B (or a caller with no key) runs one of the issue's attacks from threads of
its own. Per case: A's turns per second and its latency p50/p99 (client side), against A alone
measured just before; the goal is A keeping >= 90% of its rate and a p99 <= 2x its unloaded
p99. The control server inside each engine (case 7) is measured on its own: kvturn's
``ControlServer`` over a ``LeaseTable``, a gateway's legitimate calls (lease stats and renewals,
with the secret) against connections that idle, send bodies without the secret, or ask for
non-finite waits. Everything shares this machine's cores (the attackers too): the spread of A
alone, measured before every case, is the noise. Results: ``benchmarks/results/isolation.md``.

On a machine of 2 cores an attacker's own client takes CPU time from the gateway and from A
whatever the gateway does (the first case, a floor, measures that alone); ``--attacker idle``
runs the attacker's process under Linux's ``SCHED_IDLE`` policy instead, on what time the
others leave, as if it ran on a machine of its own, while the gateway and the engine still do
all the work its requests ask for. Each row says how many requests a second the attacker made.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _pair import server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "isolation.md"
RESULTS_IDLE = ROOT / "benchmarks" / "results" / "isolation_idle.md"
FAKE_PORT = 29401
GATEWAY_PORT = 29410
CONTROL_PORT = 29420
KEY_A, KEY_B, OPERATOR_KEY = "sk-alpha-isolation", "sk-beta-isolation", "sk-ops-isolation"
SECRET = "isolation-secret"
#: Tenant A: this many threads, each its own conversation, a turn every ``A_PACE_S`` (or as
#: soon as the last one answered): an offered load of 200 turns a second, well under what the
#: gateway serves on one core (about 900 a second here from 4 threads back to back), as a
#: tenant's traffic is in a deployment where the engines, not the gateway, are the limit. A
#: gateway saturated by A alone would share its core with any other caller, by construction.
A_THREADS = 4
A_PACE_S = 0.02


class Stop(Protocol):
    """When an attack ends, and a count of the requests it made (shared with the process of its
    own that the attack runs in)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def done(self) -> None:
        """One more request made (or connection opened: each attack says what it counts)."""


class Control:
    """:class:`Stop` over ``multiprocessing`` objects: set here, read in the attack's process."""

    def __init__(self, context: Any) -> None:
        self._stop = context.Event()
        self._made = context.Value("q", 0)

    def is_set(self) -> bool:
        return bool(self._stop.is_set())

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self._stop.wait(timeout))

    def set(self) -> None:
        self._stop.set()

    def done(self) -> None:
        with self._made.get_lock():
            self._made.value += 1

    @property
    def made(self) -> int:
        return int(self._made.value)


Attack = Callable[[Stop], None]


def _turn(client: httpx.Client, conversation: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = client.post(
        "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
    )
    response.raise_for_status()


def measure(call: Callable[[httpx.Client, str], None], base: str, key: str | None,
            seconds: float, threads: int = A_THREADS,
            pace_s: float = A_PACE_S) -> dict[str, float]:  # fmt: skip
    """``threads`` loops of ``call`` every ``pace_s`` for ``seconds``: rate, latency p50/p99
    (ms), errors."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def loop(i: int) -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
            end = time.monotonic() + seconds
            next_at = time.monotonic()
            while time.monotonic() < end:
                started = time.perf_counter()
                try:
                    call(client, f"a-{i}")
                except httpx.HTTPError:
                    with lock:
                        errors[0] += 1
                else:
                    with lock:
                        latencies.append(time.perf_counter() - started)
                next_at += pace_s
                time.sleep(max(0.0, next_at - time.monotonic()))

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    latencies.sort()
    n = len(latencies)
    return {
        "rate": n / seconds,
        "p50": statistics.median(latencies) * 1000 if n else float("nan"),
        "p99": latencies[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
        "errors": errors[0],
    }


@contextlib.contextmanager
def attacking(attack: Attack | None, threads: int, idle: bool = False) -> Iterator[Control | None]:
    """Run ``attack`` from ``threads`` threads of a process of its own for the block; yields
    its :class:`Control` (``None`` without an attack).

    Not threads of this process: A's client runs here, and attackers sharing its interpreter
    lock would slow A's own requests, whatever the server does. Measured on the control
    server's case 7 (128 KB bodies without the secret), twice each on 2 cores: A's p50 under
    attack 9.4-9.6 ms with the attackers' threads here, 3.4-4.3 ms with them in a process of
    their own.

    ``idle``: the attacker's process runs under Linux's ``SCHED_IDLE`` policy, on what CPU time
    the gateway, the engine and A leave: the stand-in for an attacker on a machine of its own,
    where its client's CPU takes nothing from the gateway's. What its requests cost the
    gateway and the engine is still theirs to bear."""
    if attack is None:
        yield None
        return
    context = multiprocessing.get_context("fork")  # the attack is a closure: not picklable
    control = Control(context)
    process = context.Process(
        target=_attack_threads, args=(attack, threads, control, idle), daemon=True
    )
    process.start()
    time.sleep(1.0)  # the attack under way before A is measured
    try:
        yield control
    finally:
        control.set()
        process.join(timeout=40)
        if process.is_alive():
            process.kill()


def _attack_threads(attack: Attack, threads: int, stop: Stop, idle: bool) -> None:
    if idle:
        # The calling thread's policy; the threads started below inherit it.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    workers = [threading.Thread(target=attack, args=(stop,), daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)


# ---- the attacks on the gateway ------------------------------------------------------------


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _try(stop: Stop, request: Callable[[], object]) -> None:
    """One request of an attack, answered or refused; counted either way."""
    with contextlib.suppress(httpx.HTTPError):
        request()
    stop.done()


def _tenant_b(timeout_s: float = 30) -> httpx.Client:
    """Tenant B's client of the gateway."""
    return httpx.Client(
        base_url=f"http://127.0.0.1:{GATEWAY_PORT}",
        headers={"Authorization": f"Bearer {KEY_B}"},
        timeout=timeout_s,
    )


def stalled_bodies(key: str | None) -> Attack:
    """Case 1: announce a 32 MiB body, send most of it, stall; again, as long as it runs."""

    def attack(stop: Stop) -> None:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        size = 32 * 1024 * 1024
        while not stop.is_set():
            conn = None
            try:
                conn = _raw(GATEWAY_PORT)
                conn.sendall(
                    f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}"
                    f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode()
                )
                chunk = b" " * (1024 * 1024)
                for _ in range(31):
                    if stop.is_set():
                        break
                    conn.sendall(chunk)
            except OSError:
                pass  # refused and closed: the stall below holds the next try back all the same
            stop.done()  # a request (announced, mostly sent)
            # Stalled, holding whatever the gateway buffered (the case: a stall, not a
            # flood of connections, which the other cases measure).
            stop.wait(10)
            if conn is not None:
                conn.close()

    return attack


def batches(stop: Stop) -> None:
    """Case 2: completion requests with the most prompts allowed (256) and with 2,000."""
    with _tenant_b(timeout_s=60) as client:
        while not stop.is_set():
            for n in (256, 2000):
                body = {"model": "fake", "prompt": [f"p{i}" for i in range(n)], "max_tokens": 4}
                _try(stop, functools.partial(client.post, "/v1/completions", json=body))


def scrapes(stop: Stop) -> None:
    """Case 3: ``/kvturn/status`` and ``/metrics`` in a loop (B's own key: refused without an
    operator's; then the operator's, which is the load an operator's dashboard puts)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{GATEWAY_PORT}", timeout=30) as client:
        while not stop.is_set():
            for key in (KEY_B, OPERATOR_KEY):
                headers = {"Authorization": f"Bearer {key}"}
                for path in ("/kvturn/status", "/metrics"):
                    _try(stop, functools.partial(client.get, path, headers=headers))


def bad_numbers(stop: Stop) -> None:
    """Cases 4 and 5: turns reporting a 1e308 ms pause, heartbeats with paused_ms 2^64."""
    with _tenant_b() as client:
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        while not stop.is_set():
            _try(stop, lambda: client.post(
                "/v1/chat/completions", json=body,
                headers={"X-Conversation-Id": "b-skew", "X-Kvturn-Pause-Ms": "1e308"},
            ))  # fmt: skip
            _try(stop, lambda: client.post(
                "/v1/kvturn/conversations/b-skew/heartbeat",
                content=b'{"pause_kind": "tool", "paused_ms": 18446744073709551616}',
                headers={"Content-Type": "application/json"},
            ))  # fmt: skip


def bad_responses(stop: Stop) -> None:
    """Case 6: Responses requests the gateway must refuse (a tool_choice without a name)."""
    with _tenant_b() as client:
        body = {"model": "fake", "input": "x", "tool_choice": {"type": "function"}}
        streamed = {"model": "fake", "input": "x", "stream": "yes"}
        while not stop.is_set():
            _try(stop, lambda: client.post("/v1/responses", json=body))
            _try(stop, lambda: client.post("/v1/responses", json=streamed))


def upgrades(stop: Stop) -> None:
    """Case 8: ``Upgrade: websocket`` requests and connections half-closed mid-request."""
    while not stop.is_set():
        with contextlib.suppress(OSError), _raw(GATEWAY_PORT) as conn:
            conn.sendall(
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nAuthorization: Bearer " + KEY_B.encode() + b"\r\n\r\n"
            )
            conn.recv(65536)
        stop.done()
        with contextlib.suppress(OSError), _raw(GATEWAY_PORT) as conn:
            body = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}]})
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY_B.encode()
                + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body[: len(body) // 2]
            )
            conn.shutdown(socket.SHUT_WR)
            conn.recv(65536)
        stop.done()


def slow_streams(stop: Stop) -> None:
    """Requests in flight: slow streams (the fake's 20 ms a chunk, 200 chunks) back to back,
    from many threads at once (the limit per tenant bounds how many the gateway serves)."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "fake_slow_stream": 200}  # fmt: skip
    with _tenant_b(timeout_s=60) as client:
        while not stop.is_set():
            _try(stop, lambda: client.post("/v1/chat/completions", json=body))


def spinning(stop: Stop) -> None:
    """The machine's floor, not an attack: a thread of a process that only computes, never
    reaching the gateway. Four of them (as four attackers' threads) take a core and switch
    among themselves; on a machine of 2 cores what that costs A is what any busy neighbour
    costs it, whatever the gateway does."""
    while not stop.is_set():
        sum(range(10_000))


#: (case, attack, attacker threads).
GATEWAY_CASES: list[tuple[str, Attack, int]] = [
    ("floor: a process of 4 busy threads, no requests", spinning, 4),
    ("1. stalled 32 MiB bodies, no key", stalled_bodies(None), 4),
    ("1. stalled 32 MiB bodies, tenant B's key", stalled_bodies(KEY_B), 4),
    ("2. batches of 256 and 2,000 prompts", batches, 4),
    ("3. /kvturn/status and /metrics in a loop", scrapes, 2),
    ("4, 5. pause 1e308 ms, heartbeat paused_ms 2^64", bad_numbers, 2),
    ("6. malformed Responses requests", bad_responses, 2),
    ("8. Upgrade: websocket, half-closed requests", upgrades, 2),
    ("in flight: 64 slow streams at once", slow_streams, 64),
]


# ---- the control server (case 7) -----------------------------------------------------------


def _control_call(client: httpx.Client, conversation: str) -> None:
    from kvturn.wire import LEASES_PATH, renew_path

    client.get(LEASES_PATH).raise_for_status()
    client.post(renew_path("lease-a"), json={"lease_s": 60}).raise_for_status()


def idle_connections(stop: Stop) -> None:
    """2,000 connections that never send a byte (the issue found a thread each, for good)."""
    held: list[socket.socket] = []
    with contextlib.suppress(OSError):
        for _ in range(2000):
            if stop.is_set():
                break
            held.append(_raw(CONTROL_PORT))
            stop.done()
    stop.wait()
    for conn in held:
        conn.close()


def unauthenticated_bodies(stop: Stop) -> None:
    """Bodies over 64 KB without the secret, and ``?wait_ms=nan``, in a loop."""
    body = b"x" * (128 * 1024)
    with httpx.Client(base_url=f"http://127.0.0.1:{CONTROL_PORT}", timeout=30) as client:
        while not stop.is_set():
            _try(stop, lambda: client.post("/kvturn/leases/lease-a/renew", content=body))
            _try(stop, lambda: client.get("/kvturn/retained/nope?wait_ms=nan"))


CONTROL_CASES: list[tuple[str, Attack, int]] = [
    ("7. 2,000 idle connections", idle_connections, 1),
    ("7. 128 KB bodies without the secret, wait_ms=nan", unauthenticated_bodies, 4),
]


#: The control server in a process of its own, as in an engine: in this one, the attackers'
#: and A's threads would share its interpreter lock.
CONTROL_SERVER = f"""
import threading, time
from kvturn.connector.control_server import ControlServer
from kvturn.connector.leases import LeaseTable
leases = LeaseTable(time.monotonic, max_lease_s=600)
leases.retain("req-a", "lease-a", "conv-a", {{"remote_num_tokens": 64}}, [[1, 2, 3, 4]], 600)
ControlServer(leases, "127.0.0.1", {CONTROL_PORT}, {SECRET!r}).start()
threading.Event().wait()
"""


# ---- running ---------------------------------------------------------------------------------


def run_cases(
    cases: list[tuple[str, Attack, int]],
    call: Callable[[httpx.Client, str], None],
    base: str,
    key: str,
    seconds: float,
    repeats: int = 1,
    idle: bool = False,
) -> list[tuple[str, list[dict[str, float]], list[dict[str, float]]]]:
    """Each case ``repeats`` times, the cases in turn (A alone right before each); under an
    attack, ``attack_rate``: the attacker's requests a second while A was measured."""
    alone: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in cases}
    under: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in cases}
    for _ in range(repeats):
        for name, attack, threads in cases:
            alone[name].append(measure(call, base, key, seconds))
            with attacking(attack, threads, idle) as control:
                made = control.made if control else 0
                result = measure(call, base, key, seconds)
                result["attack_rate"] = ((control.made if control else 0) - made) / seconds
                under[name].append(result)
            print(f"{name:50s} alone {alone[name][-1]}  under {under[name][-1]}", flush=True)
    return [(name, alone[name], under[name]) for name, _, _ in cases]


def _row(name: str, alone: list[dict[str, float]], under: list[dict[str, float]]) -> str:
    """Medians over the repeats; the ratios' range in brackets where there are several."""

    def ratio(what: str) -> list[float]:
        return [
            u[what] / a[what] if a[what] else float("nan")
            for a, u in zip(alone, under, strict=True)
        ]

    def spread(values: list[float]) -> str:
        med = f"{statistics.median(values):.2f}"
        return med if len(values) < 2 else f"{med} ({min(values):.2f}-{max(values):.2f})"

    def median(runs: list[dict[str, float]], what: str) -> float:
        return statistics.median(run[what] for run in runs)

    keeps, p99 = ratio("rate"), ratio("p99")
    rates = [run.get("attack_rate", 0.0) for run in under]
    made = statistics.median(rates)
    attack_rate = "-" if not any(rates) else f"{made:.0f}/s" if made >= 10 else f"{made:.1f}/s"
    errors = sum(run["errors"] for run in under)
    held = statistics.median(keeps) >= 0.9 and statistics.median(p99) <= 2.0 and not errors
    return (
        f"| {name} | {median(alone, 'rate'):.0f}/s, p99 {median(alone, 'p99'):.1f} ms | "
        f"{median(under, 'rate'):.0f}/s, p50 {median(under, 'p50'):.1f} ms, "
        f"p99 {median(under, 'p99'):.1f} ms | {attack_rate} | {spread(keeps)} | {spread(p99)} "
        f"| {errors:.0f} | {'yes' if held else '**no**'} |"
    )


def _raise_fd_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="each measurement's length")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each case")
    parser.add_argument(
        "--attacker", choices=("shared", "idle"), default="shared",
        help="the attacker's process: an ordinary neighbour on the same cores (shared), or "
        "under SCHED_IDLE (idle: as if on a machine of its own; results to isolation_idle.md "
        "unless --out says otherwise)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    idle = args.attacker == "idle"
    out = args.out or (RESULTS_IDLE if idle else RESULTS)
    _raise_fd_limit()  # the attackers' own sockets
    py = sys.executable
    fake = (py, "-m", "uvicorn", "tests.fake_engine:app", "--port", str(FAKE_PORT),
            "--log-level", "warning")  # fmt: skip
    gateway = (py, "-m", "kvturn.gateway.ops.cli", "serve", "--port", str(GATEWAY_PORT),
               "--no-access-log")  # fmt: skip
    env = {
        "KVTURN_PREFILL_URLS": f"http://127.0.0.1:{FAKE_PORT}",
        "KVTURN_DECODE_URLS": f"http://127.0.0.1:{FAKE_PORT}",
        "KVTURN_DECODE_CONTROL_URLS": f"http://127.0.0.1:{FAKE_PORT}",
        "KVTURN_API_KEYS": f"{KEY_A}=alpha,{KEY_B}=beta",
        "KVTURN_OPERATOR_KEYS": OPERATOR_KEY,
    }
    with server(*fake, port=FAKE_PORT), server(*gateway, port=GATEWAY_PORT, env=env):
        base = f"http://127.0.0.1:{GATEWAY_PORT}"
        gateway_rows = run_cases(
            GATEWAY_CASES, _turn, base, KEY_A, args.seconds, args.repeats, idle
        )
    with server(py, "-c", CONTROL_SERVER, port=CONTROL_PORT, http=False):
        base = f"http://127.0.0.1:{CONTROL_PORT}"
        control_rows = run_cases(
            CONTROL_CASES, _control_call, base, SECRET, args.seconds, args.repeats, idle
        )
    header = [
        "| case | A alone | A under attack | attacker's requests | A's rate kept | "
        "A's p99 ratio | A's errors | goal held (>= 0.90 rate, <= 2x p99, no error) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        "# Tenant A's service while another caller attacks (#39)",
        "",
        "Command: `.venv/bin/python benchmarks/isolation.py "
        f"--seconds {args.seconds:g} --repeats {args.repeats}"
        f"{' --attacker idle' if idle else ''}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')} UTC; {os.cpu_count()} CPU cores shared by "
        "the gateway, the fake engine, tenant A's client and the attackers; gateway "
        "`kvturn serve` (its defaults), two tenants' keys and an operator key, in front of "
        "the test suite's fake engine (`tests/fake_engine.py`). A: "
        f"{A_THREADS} threads, a conversation each, a non-streamed turn every "
        f"{A_PACE_S * 1000:.0f} ms (or once the last answered): {A_THREADS / A_PACE_S:.0f} "
        "turns/s offered; "
        f"{args.seconds:g} s a measurement; A alone measured right before each case; every "
        f"case {args.repeats} time(s), the cases in turn; cells are medians, ratios' ranges in "
        "brackets (2 cores: the p99 of one 6 s measurement moves by 2x between runs). The "
        "attacker runs in a process of its own (before 2026-12-04 23:30, as threads of A's: "
        "`isolation_16cores.md` is from then). On a machine of 2 cores the gateway, the fake "
        "engine and both callers' processes share them: an attack that keeps a process busy "
        "takes CPU time from the gateway's own loop and from A's client, whatever the gateway "
        "schedules (`scripts/device_isolation.sh` runs it on 16 cores); the first row is no "
        "attack but that floor: a process of 4 threads that only compute and never reach "
        "the gateway, as the attackers' 4 threads would take a core. "
        + (
            "**Attacker under SCHED_IDLE** (`--attacker idle`): the attacker's process runs "
            "only on CPU time the gateway, the engine and A leave, as if on a machine of its "
            "own; the gateway and the engine still do all the work its requests ask for "
            "(the attacker's requests a second say how hard it pressed). "
            if idle
            else ""
        )
        + "Attacker's requests: a second, while A was measured (median). No "
        "vLLM P/D baseline applies: this measures how the gateway keeps tenants apart "
        "(keys, per-tenant limits, its own HTTP edge) in front of a fake engine; "
        "vllm-router has no tenants or per-caller limits to compare, and no engine does work "
        "here.",
        "",
        "## The gateway",
        "",
        *header,
        *(_row(*row) for row in gateway_rows),
        "",
        "## An engine's control server (case 7)",
        "",
        "kvturn's `ControlServer` over a `LeaseTable`, on its own (a process of its own); A: "
        "the gateway's calls "
        "with the secret (lease stats, then a renewal), "
        f"{A_THREADS} threads.",
        "",
        *header,
        *(_row(*row) for row in control_rows),
        "",
    ]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
