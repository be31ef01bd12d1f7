"""``kvturn top`` against a gateway on the fake engine: the screen shows the gateway's live
figures (turns by plan, tokens, TTFT, conversations, engines), in a recorded rich console and
in a real terminal (a pseudo-terminal read through a VT emulator)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from rich.console import Console

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops import top
from kvturn.gateway.server import GatewayThread
from tests.gateway_fixtures import free_port, running_fake_engine, running_gateway


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture
def gateway(fake_url: str) -> Iterator[str]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]), decode_local=False
    )  # the same messages again reuse by a pull
    with running_gateway(config) as running:
        yield running.url


def _turns(url: str, conversation: str, n: int) -> list[str]:
    plans = []
    body = {
        "model": "fake",
        "messages": [
            {
                "role": "user",
                "content": "Read the repository and list the modules that import the wire.",
            }
        ],
        "stream": True,
    }
    for _ in range(n):
        response = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
        )
        assert response.status_code == 200
        plans.append(response.headers["x-kvturn-plan"])
    return plans


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


def _screen(renderable: Any) -> str:
    console = Console(record=True, width=160, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def _row(screen: str, first: str, skip: int = 0) -> list[str]:
    """The cells of the table row whose first cell is ``first`` (past ``skip`` such rows)."""
    for line in screen.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == first:
            if skip == 0:
                return cells
            skip -= 1
    raise AssertionError(f"no row {first!r} in:\n{screen}")


def test_top_draws_the_gateways_live_figures(gateway: str, fake_url: str) -> None:
    source = top.Source(gateway + "/v1")  # a /v1 base URL works as well as the root
    try:
        _turns(gateway, "warm-up", 2)
        before = source.scrape()
        plans = _turns(gateway, f"c-{uuid.uuid4().hex}", 4) + _turns(gateway, "other", 1)
        # A turn's KV location (so its live lease) is recorded just after its reply.
        deadline = time.monotonic() + 30
        while _metric(httpx.get(gateway + "/metrics").text, "kvturn_live_conversations") < 3:
            assert time.monotonic() < deadline, "the three conversations never went live"
            time.sleep(0.05)
        after = source.scrape()
        metrics = httpx.get(gateway + "/metrics").text
    finally:
        source.close()
    screen = _screen(top.view(after, before, source.url))

    # Turns by plan: the gateway's own counts, shares and (for this interval) a rate.
    for plan in set(plans) | {"recompute"}:
        count = _metric(metrics, f'kvturn_turns_total{{plan="{plan}"}}')
        cells = _row(screen, plan)
        assert cells[1] == f"{count:,.0f}", cells
        assert cells[3].endswith("/s") and float(cells[3][:-2]) > 0, cells
        assert cells[4].endswith(" ms") and cells[6].endswith(" ms"), cells  # p50 all / recent
    assert {"pull-reuse", "recompute"} <= set(plans)
    # Prompt tokens, reused and recomputed, as the counters say.
    reused = _metric(metrics, "kvturn_reused_tokens_total")
    assert reused > 0
    assert _row(screen, "reused")[1] == f"{reused:,.0f}"
    recomputed = _metric(metrics, "kvturn_recomputed_tokens_total")
    assert _row(screen, "recomputed")[1] == f"{recomputed:,.0f}"
    # Conversations and engines (the fake engine is prefill and decode, both healthy).
    assert _metric(metrics, "kvturn_live_conversations") == 3
    assert "live conversations 3 (in table 3)" in screen
    host = fake_url.removeprefix("http://")
    assert re.search(rf"prefill\s*│\s*{re.escape(host)}\s*│\s*up", screen), screen
    assert re.search(rf"decode\s*│\s*{re.escape(host)}\s*│\s*up", screen), screen
    # The gateway's status route answered: requests in flight per engine (none now), and the
    # planner's learned costs.
    assert after.status is not None and after.in_flight() == {fake_url: 0.0}
    assert _row(screen, "prefill")[3] == "0" and _row(screen, "decode")[3] == "0"
    assert "planner's learned costs" in screen and _row(screen, "pull")[0] == "pull"


def test_ttft_quantiles_from_buckets() -> None:
    histogram = top.Histogram({0.1: 2.0, 0.5: 6.0, 1.0: 10.0, float("inf"): 10.0}, 10.0, 4.0)
    assert histogram.quantile(0.5) == pytest.approx(0.1 + 0.4 * (3 / 4))
    assert histogram.quantile(0.9) == pytest.approx(0.5 + 0.5 * (3 / 4))
    assert histogram.quantile(0.1) == pytest.approx(0.05)
    assert top.Histogram().quantile(0.5) is None
    beyond = top.Histogram({1.0: 1.0, float("inf"): 4.0}, 4.0, 40.0)
    assert beyond.quantile(0.9) == 1.0  # past the last finite bound
    recent = histogram.minus(top.Histogram({0.1: 2.0, 0.5: 2.0, 1.0: 2.0, float("inf"): 2.0}, 2, 1))
    assert recent.count == 8 and recent.quantile(0.5) == pytest.approx(0.1 + 0.4 * (4 / 4))


def test_unknown_plans_and_the_status_route_are_drawn() -> None:
    text = (
        '# TYPE kvturn_turns_total counter\nkvturn_turns_total{plan="decode-local"} 3.0\n'
        'kvturn_turns_total{plan="recompute"} 1.0\nkvturn_turns_total{plan="future-plan"} 2.0\n'
    )
    snap = top.Snapshot.parse(text, at=10.0)
    assert snap.plans() == ["recompute", "decode-local", "future-plan"]
    snap.health = {"prefill": {"http://p0": True}, "decode": {"http://d0": False}}
    fit = {"fixed_ms": 12.25, "per_1k_tokens_ms": 310.0, "observations": 7}
    snap.status = {
        "live_conversations": 2,
        "engines": [
            {"role": "prefill", "url": "http://p0", "healthy": True, "in_flight": 3},
            {"role": "decode", "url": "http://d0", "healthy": False, "in_flight": 1},
        ],
        "planner": {"decode_local": True, "lease_s": 60.0},
        "costs": {"prefill": {"http://p0": fit}, "pull": {**fit, "observations": 0}},
        "sessions": [{"id": "chat-1", "holder": "http://d0", "lease_remaining_s": 41.5}],
    }
    screen = _screen(top.view(snap, None, "http://gw"))
    assert _row(screen, "future-plan")[1] == "2"
    assert _row(screen, "decode-local")[2] == "50%"
    assert _row(screen, "prefill")[1:4] == ["p0", "up", "3"]
    assert _row(screen, "decode")[1:4] == ["d0", "DOWN", "1"]
    assert _row(screen, "prefill", skip=1)[1:] == ["p0", "12.2 ms", "310.0 ms", "7"]
    assert _row(screen, "pull")[1:] == ["12.2 ms", "310.0 ms", "0"]
    assert _row(screen, "chat-1")[1:] == ["http://d0", "41.5"]  # a field top does not know
    assert re.search(r"planner\s+decode_local=True, lease_s=60", screen), screen


def test_kvturn_top_once_on_the_command_line(gateway: str) -> None:
    _turns(gateway, "cli", 2)
    done = subprocess.run(
        [sys.executable, "-m", "kvturn.gateway.ops.cli", "top", "--url", gateway, "--once",
         "--interval", "0.1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "150"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _row(done.stdout, "pull-reuse")[1] == "1"
    assert "turns by plan" in done.stdout and "engines" in done.stdout


class Terminal:
    """A command in a real pseudo-terminal (150x50), its output drawn by a VT emulator."""

    def __init__(self, argv: list[str]) -> None:
        import fcntl
        import pty
        import struct
        import termios
        import threading

        import pyte

        self.screen = pyte.Screen(150, 50)
        self._stream = pyte.ByteStream(self.screen)
        self._lock = threading.Lock()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "150", "LINES": "50"}
        self.process = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self._master = master
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # the command exited and its side of the terminal closed
                return
            if not data:
                return
            with self._lock:
                self._stream.feed(data)

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.screen.display)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        finally:
            os.close(self._master)


def test_kvturn_top_live_in_a_real_terminal(fake_url: str) -> None:
    """``kvturn top`` (live, not --once) in a pseudo-terminal, started before the gateway: it
    waits for the gateway, then the screen follows new turns."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    terminal = Terminal(
        [sys.executable, "-m", "kvturn.gateway.ops.cli", "top", "--url", url, "--interval", "0.3"]
    )
    gateway = None
    try:

        def wait_for(predicate: Any) -> str:
            deadline = time.monotonic() + 30
            shown = ""
            while time.monotonic() < deadline:
                shown = terminal.text()
                if predicate(shown):
                    return shown
                time.sleep(0.2)
            raise AssertionError(f"screen never showed it:\n{shown}")

        wait_for(lambda s: "(retrying)" in s)  # no gateway yet: it waits, it does not exit
        config = GatewayConfig(
            prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]),
            decode_local=False,  # the same messages again reuse by a pull
        )  # fmt: skip
        gateway = GatewayThread(config, port=port).start()
        wait_for(lambda s: "turns by plan" in s)
        _turns(url, "live-1", 3)
        shown = wait_for(lambda s: _cells(s, "pull-reuse")[:1] == ["2"])
        _turns(url, "live-1", 2)
        shown = wait_for(lambda s: _cells(s, "pull-reuse")[:1] == ["4"])
        assert "kvturn top" in shown and "live conversations 1" in shown
        assert _cells(shown, "recompute")[:2] == ["1", "20%"]
    finally:
        terminal.close()
        if gateway is not None:
            gateway.stop()


def _cells(screen: str, first: str) -> list[str]:
    try:
        return _row(screen, first)[1:]
    except AssertionError:
        return []
