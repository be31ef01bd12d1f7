"""Session fixtures: one real 1P1D vLLM pair (tiny model, float32) for the whole test run.

The pair is started through ``kvturn up`` itself, so the launcher is exercised exactly as a user
runs it; the last test of the session interrupts it and checks that no engine survives.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvturn.wire import CONTROL_SECRET_ENV

#: Engine ports for tests start here, away from ``kvturn up``'s default 8100.
TEST_BASE_PORT = int(os.environ.get("KVTURN_TEST_BASE_PORT", "18100"))
TEST_GATEWAY_PORT = TEST_BASE_PORT - 100
#: Decode retention in the test engines: long enough for any test, short enough that blocks
#: leaked by a failing test do not stay pinned for long.
TEST_KV_TTL_S = 120


@dataclass
class LocalPair:
    """The running ``kvturn up`` process and what it reported."""

    #: None when the pair was started outside the test session (``KVTURN_TEST_PAIR_STATE``).
    process: subprocess.Popen[bytes] | None
    state: dict[str, object]
    log_path: Path
    stopped: bool = field(default=False)

    @property
    def prefill_url(self) -> str:
        return str(self.state["prefill"][0])  # type: ignore[index]

    @property
    def decode_url(self) -> str:
        return str(self.state["decode"][0])  # type: ignore[index]

    @property
    def decode_control_url(self) -> str:
        return str(self.state["decode_control"][0])  # type: ignore[index]

    @property
    def control_secret(self) -> str:
        """The secret the decode engines' kvturn control servers require."""
        return str(self.state["control_secret"])

    @property
    def control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_secret}"}

    @property
    def gateway_url(self) -> str:
        """The gateway ``kvturn up`` started, as an OpenAI base URL (``…/v1``)."""
        return str(self.state["gateway"])

    @property
    def model(self) -> str:
        return str(self.state["model"])

    @property
    def engine_pids(self) -> list[int]:
        return [int(p) for p in self.state["pids"]]  # type: ignore[union-attr]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``stops_engines`` end the shared pair, so they run last (and not at all
    on a pair this session did not start)."""
    last = [i for i in items if i.get_closest_marker("stops_engines")]
    rest = [i for i in items if not i.get_closest_marker("stops_engines")]
    if REUSE_PAIR_STATE and last:
        config.hook.pytest_deselected(items=last)
        last = []
    items[:] = rest + last


#: A state file written by a ``kvturn up`` you started yourself: tests use that pair instead
#: of starting one (for quick iteration; CI never sets it). Tests that stop the engines are
#: deselected then.
REUSE_PAIR_STATE = os.environ.get("KVTURN_TEST_PAIR_STATE")


@pytest.fixture(scope="session")
def local_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPair]:
    # One control secret for every engine of the session, as in a deployment: `kvturn up`
    # takes it from the environment, and so does every extra engine a test starts (an engine
    # with a control channel and no secret refuses to start).
    if REUSE_PAIR_STATE:
        state = json.loads(Path(REUSE_PAIR_STATE).read_text())
        os.environ[CONTROL_SECRET_ENV] = str(state["control_secret"])
        yield LocalPair(None, state, Path(REUSE_PAIR_STATE), stopped=True)
        return
    os.environ.setdefault(CONTROL_SECRET_ENV, secrets.token_urlsafe(32))
    work = tmp_path_factory.mktemp("engines")
    state_file = work / "state.json"
    log_path = work / "kvturn-up.log"
    command = [
        sys.executable, "-m", "kvturn.gateway.ops.cli", "up",
        "--model", "tiny",
        "--base-port", str(TEST_BASE_PORT),
        "--kv-ttl", str(TEST_KV_TTL_S),
        "--log-dir", str(work / "logs"),
        "--state-file", str(state_file),
        "--port", str(TEST_GATEWAY_PORT),
        # Prefill holds nothing of a conversation: the engine tests prove a pull by the bytes
        # NIXL moved (a prefix cache would serve part of it), and every reference answer is
        # the prefill engine's own, computed from scratch. `kvturn up` keeps it on by default.
        "--no-prefill-prefix-cache",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while not state_file.exists():
        if process.poll() is not None:
            pytest.fail(f"kvturn up exited with {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.send_signal(signal.SIGINT)
            pytest.fail(f"engines not ready after 900 s:\n{log_path.read_text()}")
        time.sleep(1)
    pair = LocalPair(process, json.loads(state_file.read_text()), log_path)
    yield pair
    assert pair.process is not None
    if pair.process.poll() is None:
        pair.process.send_signal(signal.SIGINT)
        try:
            pair.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pair.process.kill()
