"""kvturn across "hosts": 1 prefill + 2 decode engines and the gateway, each in a Linux network
namespace of its own on a bridge, exactly as ``deploy/several_hosts.sh`` (a script for people)
sets them up.

Each engine is started by ``kvturn engine``, bound to and advertising its own address; the
gateway finds them through a deployment file (decode control servers by the port convention);
NIXL moves KV over UCX's TCP transport, and no host shares IPC or ``/dev/shm`` with another.
A conversation's history is pulled from the decode host that holds it into the prefill host;
then that decode host is unplugged (link down), and the next turn recomputes on the other
decode without a failed request. Every answer equals the prefill engine's alone.

Runs at the end of the session: it stops the session's engine pair first (this machine holds
three engines at most).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine_requests import NixlReads, long_prompt, single_engine_ids
from tests.gateway_fixtures import run_turn
from tests.test_engine_pair import _live_processes_in
from tests.test_engine_pools import _stop_session_pair

pytestmark = [pytest.mark.engines, pytest.mark.stops_engines]

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "several_hosts.sh"
TAG, NET = "kvtest", "10.232.0"
MAX_TOKENS = 24


def _script(*args: str, timeout: float = 60) -> None:
    env = {
        **os.environ,
        "KVTURN_HOSTS_TAG": TAG,
        "KVTURN_HOSTS_NET": NET,
        "KVTURN_HOSTS_ENGINE_FLAGS": "--kv-ttl 120",
        # Reuse here always pulls the history into the prefill host: the cross-host transfer
        # under test (a decode-local turn would move nothing).
        "KVTURN_DECODE_LOCAL": "0",
    }
    subprocess.run([str(SCRIPT), *args], env=env, check=True, timeout=timeout)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith(TAG)]


@pytest.fixture
def hosts(local_pair: Any, tmp_path: Path) -> Any:
    _stop_session_pair(local_pair)
    _script("down", str(tmp_path))  # whatever a crashed earlier run left
    try:
        _script("up", str(tmp_path), timeout=1200)
        state = json.loads((tmp_path / "hosts.json").read_text())
        state["secret"] = (tmp_path / "control-secret").read_text().strip()
        yield state
    finally:
        groups = set()
        for pid_file in tmp_path.glob("*.pid"):
            groups.add(int(pid_file.read_text()))
        _script("down", str(tmp_path), timeout=120)
        assert _live_processes_in(groups) == []
        assert _namespaces() == []


def _retained(state: dict[str, Any], i: int) -> int:
    url = f"{state['decode_control'][i]}/kvturn/leases"
    stats = httpx.get(url, headers={"Authorization": f"Bearer {state['secret']}"}, timeout=10)
    return int(stats.json()["retained"])


def _pulled_from_a_holder(state: dict[str, Any]) -> tuple[Any, list[Any], str, int, Any]:
    """A conversation's first turn, then a second that prefill's host pulls from the decode
    host holding the first (over TCP), answers equal to the prefill engine's alone: the client,
    the messages so far, the conversation id, the holder (0 or 1) and the second turn."""
    client = openai.OpenAI(
        base_url=state["gateway"], api_key=state["api_key"], max_retries=0, timeout=300
    )
    model, prefill = state["model"], state["prefill"][0]
    cid = f"hosts-{uuid.uuid4()}"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": long_prompt(1500, f"hosts {uuid.uuid4()}")}
    ]

    before = [_retained(state, i) for i in (0, 1)]
    first = run_turn(client, model, messages, cid, max_tokens=MAX_TOKENS)
    assert first.token_ids == single_engine_ids(prefill, model, messages, MAX_TOKENS)
    holders = [i for i in (0, 1) if _retained(state, i) > before[i]]
    assert len(holders) == 1, holders

    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then? Say it in a few words."},
    ]
    reads = NixlReads(prefill)
    second = run_turn(client, model, messages, cid, max_tokens=MAX_TOKENS)
    assert second.plan == "pull-reuse", (second.plan, second.reason)
    assert second.reused_tokens > 1000
    reads.wait_for(1, min_bytes=1)  # prefill's host read the history from the decode host
    assert second.token_ids == single_engine_ids(prefill, model, messages, MAX_TOKENS)
    return client, messages, cid, holders[0], second


def test_reuse_across_hosts_and_a_decode_host_unplugged(hosts: dict[str, Any]) -> None:
    state = hosts
    for pid in state["pids"].values():  # UCX's TCP transport only, in every engine
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"UCX_TLS=tcp" in environ or pid == state["pids"]["gw"]
    client, messages, cid, holder, second = _pulled_from_a_holder(state)
    model, prefill, other = state["model"], state["prefill"][0], 1 - holder

    # The decode host holding the conversation is unplugged: the next turn is still answered,
    # recomputed on the other decode host, and no slower than the gateway's own timeouts.
    _script("cut", {0: "d1", 1: "d2"}[holder])
    messages += [
        {"role": "assistant", "content": second.text},
        {"role": "user", "content": "One more thing, briefly."},
    ]
    other_reads = NixlReads(state["decode"][other])
    started = time.monotonic()
    third = run_turn(client, model, messages, cid, max_tokens=MAX_TOKENS)
    took = time.monotonic() - started
    assert third.plan == "recompute", (third.plan, third.reason)
    other_reads.wait_for(1, min_bytes=1)  # the other decode host read the new prompt's KV
    assert third.token_ids == single_engine_ids(prefill, model, messages, MAX_TOKENS)
    assert took < 30, f"the turn after the cut took {took:.1f} s"

    # And reuse resumes from the decode host that served it: a pull is planned. Prefill's own
    # prefix cache (on, as `kvturn engine` runs it) holds turn 3's prompt, recomputed there;
    # where it held all the lease did, vLLM reads nothing and the gateway says so.
    messages += [
        {"role": "assistant", "content": third.text},
        {"role": "user", "content": "Last one."},
    ]
    fourth = run_turn(client, model, messages, cid, max_tokens=MAX_TOKENS)
    assert fourth.plan == "pull-reuse" or (fourth.plan, fourth.reason) == (
        "recompute",
        "prefill-cached",
    ), (fourth.plan, fourth.reason)
    assert fourth.reused_tokens > 1000
    assert fourth.token_ids == single_engine_ids(prefill, model, messages, MAX_TOKENS)


def _black_hole(host: str) -> None:
    """Drop every packet of ``host`` but its API's and its control server's: its engine and
    lease routes answer, its KV transfers go nowhere (nothing refused, nothing reset)."""
    namespace = ["ip", "netns", "exec", f"{TAG}-{host}", "iptables", "-A"]
    for chain, port_flag, link_flag in (("INPUT", "--dport", "-i"), ("OUTPUT", "--sport", "-o")):
        for port in ("8000", "8300"):
            rule = [chain, "-p", "tcp", port_flag, port, "-j", "ACCEPT"]
            subprocess.run([*namespace, *rule], check=True)
        subprocess.run([*namespace, chain, link_flag, "lo", "-j", "ACCEPT"], check=True)
        subprocess.run([*namespace, chain, "-j", "DROP"], check=True)


def test_a_holder_whose_kv_transfers_go_nowhere(hosts: dict[str, Any]) -> None:
    """Measured before the fix: with the holder's NIXL traffic dropped (its API and control
    server still answering), the turn's KV read waited out the gateway's 600 s request timeout,
    and with reads timing out, decode's failure came inside a 200 stream and reached the client
    as an error. Now a read gives up after UCX's TCP user timeout (``kvturn engine`` sets 5 s),
    a decode that fails before its first token is served again elsewhere, and the turn is
    answered, rightly, in seconds."""
    state = hosts
    client, messages, cid, holder, second = _pulled_from_a_holder(state)
    model, prefill = state["model"], state["prefill"][0]

    _black_hole({0: "d1", 1: "d2"}[holder])
    messages += [
        {"role": "assistant", "content": second.text},
        {"role": "user", "content": "One more thing, briefly."},
    ]
    started = time.monotonic()
    third = run_turn(client, model, messages, cid, max_tokens=MAX_TOKENS)
    took = time.monotonic() - started
    assert third.plan == "recompute", (third.plan, third.reason)
    assert third.reason in ("decode-failed", "pull-failed"), third.reason
    assert third.token_ids == single_engine_ids(prefill, model, messages, MAX_TOKENS)
    assert took < 60, f"the turn took {took:.1f} s"
