"""``kvturn up --prefill 1 --decode 2``: a pool of real decode engines behind one gateway.

Runs at the very end of the session: it first stops the session's pair (this machine holds
three engines at most), then starts the pool exactly as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import TEST_BASE_PORT, LocalPair
from tests.engine_requests import long_prompt, single_engine_ids
from tests.gateway_fixtures import metric, run_turn
from tests.test_engine_pair import _live_processes_in

pytestmark = [pytest.mark.engines, pytest.mark.stops_engines]

POOL_BASE_PORT = TEST_BASE_PORT + 500


def _stop_session_pair(pair: LocalPair) -> None:
    if pair.process is not None and pair.process.poll() is None:
        pair.process.send_signal(signal.SIGINT)
        pair.process.wait(timeout=120)


def _decode_counters(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Each decode's (requests finished, prompt tokens its prefix cache served)."""
    return {
        url: (
            metric(f"{url}/metrics", "vllm:request_success_total"),
            metric(f"{url}/metrics", "vllm:prefix_cache_hits_total"),
        )
        for url in urls
    }


def _served_by(urls: list[str], before: dict[str, tuple[float, float]]) -> tuple[str, float]:
    """The one decode that finished a request since ``before``, and its prefix-cache hits
    since then (vLLM updates its counters as each step's stats come in: waited for)."""
    deadline = time.monotonic() + 10
    while True:
        now = _decode_counters(urls)
        done = [url for url in urls if now[url][0] > before[url][0]]
        if len(done) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(done) == 1, f"decodes that finished a request: {done}"
    url = done[0]
    while now[url][1] == before[url][1] and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _decode_counters(urls)
    return url, now[url][1] - before[url][1]


def test_a_conversation_reuses_on_whichever_decode_holds_it(
    local_pair: LocalPair, tmp_path: Path
) -> None:
    _stop_session_pair(local_pair)
    state_file = tmp_path / "state.json"
    command = [
        sys.executable, "-m", "kvturn.gateway.ops.cli", "up", "--model", "tiny",
        "--prefill", "1", "--decode", "2", "--base-port", str(POOL_BASE_PORT),
        "--port", str(POOL_BASE_PORT - 10), "--kv-ttl", "120",
        "--log-dir", str(tmp_path / "logs"), "--state-file", str(state_file),
    ]  # fmt: skip
    # The turns below must continue on their holders: a pull predicted within noise of a
    # local prefill (on one host the two are) must not win (see tests/test_planner_engines.py).
    env = {**os.environ, "KVTURN_LOCAL_PREFERENCE": "1.0"}
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + 900
        while not state_file.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "the pool never became ready"
            time.sleep(1)
        state: dict[str, Any] = json.loads(state_file.read_text())
        groups = {os.getpgid(pid) for pid in state["pids"]}
        assert len(state["decode"]) == 2 and len(state["prefill"]) == 1
        client = openai.OpenAI(base_url=state["gateway"], api_key="-", max_retries=0, timeout=300)
        model, prefill = state["model"], state["prefill"][0]

        # A's first reply is still streaming when B's turn comes: B goes to the other decode.
        histories = {
            name: [{"role": "user", "content": long_prompt(700, f"{name} {uuid.uuid4()}")}]
            for name in ("pool-a", "pool-b")
        }
        stream = client.chat.completions.create(
            model=model, messages=histories["pool-a"], max_tokens=300, temperature=0,
            stream=True, extra_headers={"X-Conversation-Id": "pool-a"},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text_a = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text_a += chunk.choices[0].delta.content
                break
        first_b = run_turn(client, model, histories["pool-b"], "pool-b")
        for chunk in stream:  # the rest of A's reply
            if chunk.choices:
                text_a += chunk.choices[0].delta.content or ""

        def served() -> list[float]:
            return [metric(f"{u}/metrics", "vllm:request_success_total") for u in state["decode"]]

        deadline = time.monotonic() + 60
        while not all(count >= 1 for count in served()):
            assert time.monotonic() < deadline, f"requests per decode: {served()}"
            time.sleep(1)

        replies = {"pool-a": text_a, "pool-b": first_b.text}
        for name in ("pool-a", "pool-b"):
            messages = [
                *histories[name],
                {"role": "assistant", "content": replies[name]},
                {"role": "user", "content": "Go on, in one line."},
            ]
            before = _decode_counters(state["decode"])
            got = run_turn(client, model, messages, name)
            # A short suffix: the turn continues on the decode that holds the conversation.
            assert got.plan == "decode-local", name
            assert got.reused_tokens > 600, name
            assert got.token_ids == single_engine_ids(prefill, model, messages, 16), name
            # The engines' own evidence, not the gateway's header: exactly one decode served
            # the turn, and its prefix cache served at least what the gateway claims. The
            # conversation's first block is unique to it (a fresh uuid), so only the decode
            # holding it could; sent to the other decode, the turn would still answer right
            # and the header would still claim the same.
            served_by, hits = _served_by(state["decode"], before)
            assert hits >= got.reused_tokens, (name, served_by, hits, got.reused_tokens)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=120) == 0
        assert _live_processes_in(groups) == []
