"""``kvturn serve --workers N``: N gateway processes on one port, one Redis table between them.

Run as a user runs it (the command, in its own process group), in front of the fake engine:
every new connection may land on either worker, and every turn after the first reuses; a
worker killed outright is replaced while turns go on; SIGTERM stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_fixtures import RedisServer, free_port, running_fake_engine, running_redis


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _workers(supervisor: int) -> set[int]:
    """The supervisor's worker processes (spawned interpreters; not its resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            status = (entry / "status").read_text()
            ppid = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")
            )
            if ppid == supervisor and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def _exited(pid: int) -> bool:
    """Gone, or a zombie (its sockets closed) that its parent has not reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines())


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


def _turn(url: str, cid: str) -> str:
    # A fresh client each time: a new connection, which the kernel may give to either worker.
    with httpx.Client(timeout=30) as client:
        response = client.post(
            url + "/v1/chat/completions",
            json={
                "model": "fake",
                "messages": [
                    {
                        "role": "user",
                        "content": "Read the repository and list the modules that import the wire.",
                    }
                ],
            },
            headers={"X-Conversation-Id": cid},
        )
    assert response.status_code == 200, response.text
    return response.headers["x-kvturn-plan"]


def _turns_counted(url: str) -> int:
    """Turns counted by the /metrics of the worker that answers this new connection."""
    with httpx.Client(timeout=10) as client:
        text = client.get(url + "/metrics").text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvturn_turns_total{")
        )
    )


def _served_by(url: str) -> tuple[int, int]:
    """(pid, turns it served) of the worker that answers this new connection."""
    with httpx.Client(timeout=10) as client:
        process = client.get(url + "/kvturn/status").json()["process"]
    return process["pid"], process["turns_served"]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def test_workers_share_one_port_and_one_table(fake_url: str, redis_server: RedisServer) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "kvturn.gateway.ops.cli", "serve",
        "--prefill", fake_url, "--decode", fake_url, "--decode-control", fake_url,
        "--port", str(port), "--workers", "2", "--state", redis_server.url,
        "--decode-local", "off",  # the same messages again reuse by a pull
    ]  # fmt: skip
    process = subprocess.Popen(command, start_new_session=True)
    try:

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=2).status_code == 200
            return False

        _wait(healthy, 60, "the gateway answers")
        _wait(lambda: len(_workers(process.pid)) == 2, 30, "two workers run")
        plans = [_turn(url, "shared") for _ in range(20)]
        assert plans == ["recompute"] + ["pull-reuse"] * 19, plans
        # Both workers served turns (the kernel spreads new connections by their addresses:
        # all 20 on one worker has odds of 2 in 2^20); any worker's /metrics counts all 20.
        served = dict(_served_by(url) for _ in range(24))
        assert len(served) == 2 and sum(served.values()) == 20 and min(served.values()) > 0
        assert {_turns_counted(url) for _ in range(8)} == {20}

        # A worker killed outright: the supervisor starts another; turns go on meanwhile.
        victim = min(_workers(process.pid))
        os.kill(victim, signal.SIGKILL)
        # Until it has exited, its listening socket may still be handed connections.
        _wait(lambda: _exited(victim), 10, "the killed worker exits")
        plans = [_turn(url, "shared") for _ in range(4)]
        assert set(plans) <= {"pull-reuse", "recompute"}
        _wait(lambda: len(_workers(process.pid) - {victim}) == 2, 30, "a new worker runs")
        assert _turn(url, "shared") == "pull-reuse"
        # The killed worker's turns still count: counters never go back.
        assert {_turns_counted(url) for _ in range(8)} == {25}

        workers = _workers(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 10, "workers end")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_workers_need_a_port_of_their_own() -> None:
    from kvturn.gateway.config import GatewayConfig, endpoints
    from kvturn.gateway.server import GatewayWorkers

    config = GatewayConfig(prefill=endpoints(["http://p"]), decode=endpoints(["http://d"]))
    with pytest.raises(ValueError, match="port"):
        GatewayWorkers(config, "127.0.0.1", 0, 2)
