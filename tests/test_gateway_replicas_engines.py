"""Gateway replicas on real engines: separate ``kvturn serve`` processes sharing one Redis.

Whichever replica serves a turn reuses the KV the previous turn (served by another replica)
left on decode; two parallel turns of one conversation on two replicas never both pull it; a
Redis outage costs reuse, never an answer, and reuse resumes one turn after Redis is back; a
replica restarted keeps reuse. Every answer is compared, by token ids, with one engine alone
under a fresh cache salt; a planned pull must show as NIXL reads on prefill.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn import control
from tests.conftest import LocalPair
from tests.engine_requests import NixlReads, long_prompt, single_engine_ids
from tests.gateway_fixtures import RedisServer, TurnResult, free_port, run_turn, running_redis

pytestmark = pytest.mark.engines

MAX_TOKENS = 12
REUSE_PLANS = ("pull-reuse", "decode-local")


class Replica:
    """One ``kvturn serve`` process in front of the session's engine pair."""

    def __init__(self, pair: LocalPair, state: str, log: Path):
        self.pair, self.state, self.log = pair, state, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        command = [
            sys.executable, "-m", "kvturn.gateway.ops.cli", "serve",
            "--prefill", self.pair.prefill_url, "--decode", self.pair.decode_url,
            "--decode-control", self.pair.decode_control_url,
            "--port", str(self.port), "--state", self.state,
        ]  # fmt: skip
        env = {**os.environ, "KVTURN_CONTROL_SECRET": self.pair.control_secret}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "replica did not start in 60 s"
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM: the replica lets in-flight work (records of finished turns) finish."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture
def replicas(
    local_pair: LocalPair, redis_server: RedisServer, tmp_path: Path
) -> Iterator[list[Replica]]:
    running = [Replica(local_pair, redis_server.url, tmp_path / f"replica-{i}.log") for i in (0, 1)]
    try:
        for replica in running:
            replica.start()
        yield running
    finally:
        for replica in running:
            replica.stop()


def _history(topic: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are an agent that reads tool output carefully."},
        {"role": "user", "content": long_prompt(1400, topic)},
    ]


def _next(messages: list[dict[str, Any]], reply: TurnResult, turn: int) -> list[dict[str, Any]]:
    tool = {"role": "tool", "content": f"result {turn}: " + "the gauge reads 7. " * 8}
    return [*messages, {"role": "assistant", "content": reply.text}, tool]


def _turn(
    pair: LocalPair, replica: Replica, messages: list[dict[str, Any]], cid: str, stream: bool = True
) -> TurnResult:
    """A turn through ``replica``, checked against one engine alone."""
    reads = NixlReads(pair.prefill_url)
    got = run_turn(
        replica.client(), pair.model, messages, cid, stream=stream, max_tokens=MAX_TOKENS
    )
    want = single_engine_ids(pair.prefill_url, pair.model, messages, MAX_TOKENS)
    assert got.token_ids == want, f"{got.plan} changed the answer"
    if got.plan == "pull-reuse":
        reads.wait_for(1, min_bytes=1000 * 4096)  # the history came from decode
    return got


def _release(replica: Replica, cid: str) -> None:
    response = httpx.delete(replica.url + "/v1" + control.release_path(cid), timeout=30)
    assert response.status_code == 200, response.text


def _lease_counts(pair: LocalPair) -> tuple[int, int]:
    """Leases decode has granted, and those that ended other than by lapsing (read,
    superseded, released, reclaimed). Other tests' leases left on this shared pair only lapse,
    so between two readings the two grow alike exactly when every lease granted meanwhile
    ended: none leaked."""
    url = f"{pair.decode_control_url}/kvturn/leases"
    stats = httpx.get(url, headers=pair.control_headers, timeout=10).json()
    ended = dict(stats["ended"])
    return int(stats["retained"]), sum(ended.values()) - int(ended.get("expired", 0))


def _assert_every_lease_ended(pair: LocalPair, before: tuple[int, int]) -> None:
    deadline = time.monotonic() + 30
    while True:
        retained, ended = _lease_counts(pair)
        granted, gone = retained - before[0], ended - before[1]
        if gone == granted or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the engine frees a read lease's blocks on its next step
    assert granted > 0 and gone == granted, (granted, gone)


def test_turns_alternating_between_replicas_reuse_and_survive_a_replica_restart(
    local_pair: LocalPair, replicas: list[Replica]
) -> None:
    cid = f"replicas-{uuid.uuid4().hex[:8]}"
    leases = _lease_counts(local_pair)
    messages = _history("tidal locks")
    plans = []
    for turn in range(4):
        got = _turn(local_pair, replicas[turn % 2], messages, cid)
        plans.append(got.plan)
        if turn:
            assert got.plan in REUSE_PLANS and got.reused_tokens > 1000, (turn, got)
        messages = _next(messages, got, turn)
    assert plans[0] == "recompute"
    # The replica that served the last turn is restarted: its successor (and the other
    # replica) still find the conversation's KV in Redis.
    replicas[1].stop()
    replicas[1].start()
    got = _turn(local_pair, replicas[1], messages, cid)
    assert got.plan in REUSE_PLANS and got.reused_tokens > 1000, got
    _release(replicas[0], cid)
    _assert_every_lease_ended(local_pair, leases)  # every turn's KV was read or freed


def test_parallel_turns_on_two_replicas_never_pull_the_same_kv(
    local_pair: LocalPair, replicas: list[Replica]
) -> None:
    cid = f"parallel-{uuid.uuid4().hex[:8]}"
    leases = _lease_counts(local_pair)
    messages = _history("canal boats")
    first = _turn(local_pair, replicas[0], messages, cid)
    messages = _next(messages, first, 0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_turn, local_pair, r, messages, cid, False) for r in replicas]
        results = [f.result() for f in futures]
    plans = sorted((r.plan or "", r.reason or "") for r in results)
    # One took the KV; the other found it taken by a turn still in flight and read it on the
    # same decode without taking it (or, had the first been recorded by then, continued on
    # its record). Never two pulls of the same lease. Both answered right.
    assert all(plan in REUSE_PLANS for plan, _ in plans), plans
    assert sum(plan == "pull-reuse" for plan, _ in plans) <= 1, plans
    assert all(r.reused_tokens > 1000 for r in results), results
    _release(replicas[1], cid)
    # The turn that recorded last replaced the other's KV, which was freed on decode.
    _assert_every_lease_ended(local_pair, leases)


def test_a_redis_outage_costs_reuse_never_an_answer(
    local_pair: LocalPair, replicas: list[Replica], redis_server: RedisServer
) -> None:
    cid = f"outage-{uuid.uuid4().hex[:8]}"
    messages = _history("glass furnaces")
    for turn in range(2):
        got = _turn(local_pair, replicas[turn], messages, cid)
        messages = _next(messages, got, turn)
    assert got.plan in REUSE_PLANS
    redis_server.stop()
    try:
        for turn in (2, 3):
            got = _turn(local_pair, replicas[turn % 2], messages, cid)
            assert (got.plan, got.reason) == ("recompute", "state-unavailable")
            messages = _next(messages, got, turn)
    finally:
        redis_server.start()
    # Redis is back, empty: the next turn records where its KV is, the one after reuses.
    got = _turn(local_pair, replicas[0], messages, cid)
    assert got.plan == "recompute"
    messages = _next(messages, got, 4)
    got = _turn(local_pair, replicas[1], messages, cid)
    assert got.plan in REUSE_PLANS and got.reused_tokens > 1000, got
    _release(replicas[0], cid)
