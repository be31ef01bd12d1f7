"""The gateway's attack cases (issue #13) against each HTTP server that could serve it: the
gateway's own server (``kvturn serve``) and the same gateway app under uvicorn (httptools, h11)
and granian, each with the closest settings it has to the gateway's own limits.

    .venv/bin/python benchmarks/http_robustness.py      # granian: pip install granian==2.8.7

Each server runs in its own process with a soft limit of 1,024 file descriptors (the usual
default), in front of the test suite's fake engine (``tests/fake_engine.py``, which can delay a
reply and count requests its client abandoned). Each case is bounded in time and reports what
the server did; results: ``benchmarks/results/http_robustness.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _pair import server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "http_robustness.md"
FAKE_PORT = 29301
PORTS = {"kvturn": 29310, "uvicorn-httptools": 29311, "uvicorn-h11": 29312, "granian": 29313}
#: The gateway's own limits here, and each other server's closest setting.
READ_TIMEOUT_S = 5
MAX_CONNECTIONS = 300
TURN = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
#: How long a trickle may run before the case says the server never ended it.
TRICKLE_FOR_S = 20


def commands(py: str) -> dict[str, tuple[tuple[str, ...], str]]:
    """Each server's command, and the settings given (as the table shows them)."""
    fake = f"http://127.0.0.1:{FAKE_PORT}"
    found: dict[str, tuple[tuple[str, ...], str]] = {
        "kvturn": (
            (py, "-m", "kvturn.gateway.ops.cli", "serve", "--prefill", fake, "--decode", fake,
             "--decode-control", fake, "--port", str(PORTS["kvturn"]),
             "--read-timeout-s", str(READ_TIMEOUT_S),
             "--max-connections", str(MAX_CONNECTIONS)),
            f"--read-timeout-s {READ_TIMEOUT_S} --max-connections {MAX_CONNECTIONS}",
        ),
    }  # fmt: skip
    uvicorn = (py, "-m", "uvicorn", "--factory", "--app-dir", "benchmarks", "asgi_gateway:app",
               "--loop", "uvloop", "--log-level", "warning", "--no-access-log",
               "--limit-concurrency", str(MAX_CONNECTIONS),
               "--timeout-keep-alive", str(READ_TIMEOUT_S))  # fmt: skip
    shown = f"--limit-concurrency {MAX_CONNECTIONS} --timeout-keep-alive {READ_TIMEOUT_S}"
    for http in ("httptools", "h11"):
        port = str(PORTS[f"uvicorn-{http}"])
        found[f"uvicorn-{http}"] = ((*uvicorn, "--http", http, "--port", port), shown)
    granian = Path(py).parent / "granian"
    if granian.exists():
        found["granian"] = (
            (str(granian), "--interface", "asgi", "--factory", "--loop", "uvloop",
             "--working-dir", "benchmarks", "--log-level", "warning",
             "--http1-header-read-timeout", str(READ_TIMEOUT_S * 1000),
             "--backpressure", str(MAX_CONNECTIONS),
             "--host", "127.0.0.1", "--port", str(PORTS["granian"]), "asgi_gateway:app"),
            f"--http1-header-read-timeout {READ_TIMEOUT_S * 1000} "
            f"--backpressure {MAX_CONNECTIONS}",
        )  # fmt: skip
    return found


def _usual_fd_limit() -> None:
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )


# ---- HTTP/1.1 by hand ------------------------------------------------------------------------


def post(body: bytes, extra: str = "") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + extra.encode()
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def read_response(conn: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str]]:
    """One response's status and headers; its body (content-length or chunked) consumed."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            raise ConnectionError("closed before a response")
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    buffer[:] = rest
    if status == 100:
        return status, headers
    if "content-length" in headers:
        need = int(headers["content-length"])
        while len(buffer) < need:
            data = conn.recv(65536)
            if not data:
                break
            buffer += data
        del buffer[:need]
    elif headers.get("transfer-encoding") == "chunked":
        while b"0\r\n\r\n" not in buffer:
            data = conn.recv(65536)
            if not data:
                break
            buffer += data
        del buffer[: buffer.index(b"0\r\n\r\n") + 5]
    return status, headers


def _answer(conn: socket.socket) -> str:
    try:
        status, _ = read_response(conn, bytearray())
        return str(status)
    except (ConnectionError, OSError):
        return "closed"


# ---- the cases -------------------------------------------------------------------------------


def trickled(port: int, first: bytes, then: bytes) -> str:
    """Send ``first``, then ``then`` a byte every 0.5 s: when and how the server ended it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(first)
        started = time.monotonic()
        conn.settimeout(0.5)
        for i in range(TRICKLE_FOR_S * 2):
            try:
                data = conn.recv(65536)
                took = time.monotonic() - started
                if not data:
                    return f"closed after {took:.1f} s, no answer"
                return f"{data.split(b' ', 2)[1].decode()} after {took:.1f} s"
            except TimeoutError:
                pass
            with contextlib.suppress(OSError):
                conn.send(then[i % len(then) : i % len(then) + 1])
        return f"**still open after {TRICKLE_FOR_S} s**"


def slow_head(port: int) -> str:
    return trickled(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n", b"x-a: b\r\n")


def slow_body(port: int) -> str:
    head = post(b"")[: -len(b"content-length: 0\r\n\r\n")] + b"content-length: 2000\r\n\r\n"
    return trickled(port, head + b'{"mo', b"x")


def _rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def huge_header(port: int, pid: int) -> str:
    """A 64 MB header line: how much went in, the answer, the server's peak memory and CPU,
    and the slowest ``/health`` of another client meanwhile."""
    peak, cpu = _rss_peak_kb(pid), _cpu_s(pid)
    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                started = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    client.get(f"http://127.0.0.1:{port}/health", timeout=30)
                health.append(time.monotonic() - started)
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    sent = 0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-long: ")
            with contextlib.suppress(OSError):
                while sent < 64 * 1024 * 1024:
                    conn.sendall(b"a" * 65536)
                    sent += 65536
                conn.sendall(b"\r\n\r\n")
            answer = _answer(conn)
    finally:
        stop.set()
        prober.join()
    grown = (_rss_peak_kb(pid) - peak) / 1024
    return (
        f"{answer} after {sent / 2**20:.1f} MB in; peak RSS +{grown:.0f} MB, "
        f"{_cpu_s(pid) - cpu:.2f} s CPU; {len(health)} `/health` meanwhile, slowest "
        f"{max(health, default=0):.2f} s"
    )


def many_connections(port: int) -> str:
    """1,100 idle connections, then one ordinary turn on a new one."""
    held = []
    try:
        for _ in range(1100):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(0.5)
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                conn.sendall(post(TURN))
                answer = _answer(conn)
        except OSError as error:
            answer = f"connect failed ({type(error).__name__})"
        took = time.monotonic() - started
        shown = answer if answer in ("200", "503") else f"**{answer}**"  # 503: the cap, said
        return f"{len(held)} held; a new turn: {shown} in {took:.2f} s"
    finally:
        for conn in held:
            conn.close()
        time.sleep(1.0)


def _counts() -> dict[str, int]:
    return dict(httpx.get(f"http://127.0.0.1:{FAKE_PORT}/fake/counts", timeout=10).json())


def abandoned(port: int) -> str:
    """A non-streamed turn whose client leaves after 0.5 s: was the engine request cancelled?"""
    before = _counts().get("abandoned_requests", 0)
    slow = orjson.dumps({**orjson.loads(TURN), "fake_delay_ms": 5000})
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(post(slow))
        time.sleep(0.5)
    started = time.monotonic()
    while time.monotonic() - started < 4:
        if _counts().get("abandoned_requests", 0) > before:
            return f"engine request cancelled after {0.5 + time.monotonic() - started:.1f} s"
        time.sleep(0.05)
    return "**engine request ran on (5 s)**"


def pipelined_expect(port: int) -> str:
    slow = orjson.dumps({**orjson.loads(TURN), "fake_delay_ms": 300})
    expecting = post(TURN, extra="expect: 100-continue\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(post(slow) + expecting[: -len(TURN)])
        buffer = bytearray()
        try:
            first, _ = read_response(conn, buffer)
            second, _ = read_response(conn, buffer)
        except (ConnectionError, OSError) as error:
            return f"**{type(error).__name__} (no 100 within 5 s)**"
        if second != 100:
            return f"**{first} then {second}, no 100**"
        conn.sendall(TURN)
        try:
            third, _ = read_response(conn, buffer)
        except (ConnectionError, OSError):
            return "**100, then no answer**"
        return f"{first}, 100, {third}"


def trailers(port: int) -> str:
    body = b"%x\r\n%s\r\n0\r\nX-Conversation-Id: from-a-trailer\r\n\r\n" % (len(TURN), TURN)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head + body)
        status, headers = read_response(conn, bytearray())
    cid = headers.get("x-conversation-id", "")
    verdict = "**trailer became the id**" if cid == "from-a-trailer" else "ignored"
    return f"{status}, {verdict}"


CASES: dict[str, Callable[[int, int], str]] = {
    "head trickled (1 byte / 0.5 s)": lambda port, pid: slow_head(port),
    "body trickled (1 byte / 0.5 s)": lambda port, pid: slow_body(port),
    "64 MB header line": huge_header,
    "1,100 idle connections, then a turn": lambda port, pid: many_connections(port),
    "client leaves a non-streamed turn": lambda port, pid: abandoned(port),
    "pipelined `Expect: 100-continue`": lambda port, pid: pipelined_expect(port),
    "chunked trailer `X-Conversation-Id`": lambda port, pid: trailers(port),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # the attacker's own
    py = sys.executable
    fake = (py, "-m", "uvicorn", "tests.fake_engine:app", "--port", str(FAKE_PORT),
            "--log-level", "warning")  # fmt: skip
    env = {
        "KVTURN_PREFILL_URLS": f"http://127.0.0.1:{FAKE_PORT}",
        "KVTURN_DECODE_URLS": f"http://127.0.0.1:{FAKE_PORT}",
        "KVTURN_DECODE_CONTROL_URLS": f"http://127.0.0.1:{FAKE_PORT}",
    }
    servers = commands(py)
    found: dict[str, dict[str, str]] = {}
    with server(*fake, port=FAKE_PORT):
        for name, (command, _) in servers.items():
            with server(*command, port=PORTS[name], env=env, preexec_fn=_usual_fd_limit) as proc:
                pid = proc.pid
                found[name] = {}
                for case, run in CASES.items():
                    try:
                        found[name][case] = run(PORTS[name], pid)
                    except Exception as error:  # a case that broke is a result too
                        found[name][case] = f"**{type(error).__name__}: {error}**"[:200]
                    print(f"{name:18s} {case:40s} {found[name][case]}", flush=True)
    lines = [
        "# The gateway's attack cases, by HTTP server",
        "",
        "Command: `.venv/bin/python benchmarks/http_robustness.py`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; each server one process in front of the "
        "fake engine (`tests/fake_engine.py`), soft limit of 1,024 file descriptors; the same "
        "gateway app under each (`benchmarks/asgi_gateway.py` for the ASGI servers). Bold: the "
        "server did not bound the case.",
        "",
        "Settings: "
        + "; ".join(f"{name}: `{shown}`" for name, (_, shown) in servers.items())
        + ".",
        "",
        "| case | " + " | ".join(found) + " |",
        "|---|" + "---|" * len(found),
        *(
            f"| {case} | " + " | ".join(found[name][case] for name in found) + " |"
            for case in CASES
        ),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
