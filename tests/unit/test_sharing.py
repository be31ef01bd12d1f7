"""Sharing (:mod:`kvturn.gateway.turns.sharing`): the choice of a plan on KV another turn owns,
what the index keeps of a turn, and forks on the fake engine (that a fork never takes its
parent's KV; real reuse of shared KV is shown on real engines, tests/test_sharing_engines.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.planner import CostModel, LocalLimits, SharedInputs, choose_shared
from kvturn.gateway.state.implicit import Indexed
from tests.gateway_fixtures import running_fake_engine, running_gateway

LIMITS = LocalLimits(max_suffix_tokens=2048, max_running=8)


def _inputs(**overrides: Any) -> SharedInputs:
    values: dict[str, Any] = {
        "kind": "fork",
        "prompt_tokens": 4_300,
        "covered_tokens": 4_096,
        "holder_running": 0,
        "holder_url": "http://decode",
        "prefill_url": "http://prefill",
        **overrides,
    }
    return SharedInputs(**values)


def test_a_fork_is_served_on_the_decode_holding_what_it_shares() -> None:
    plan = choose_shared(_inputs(), LIMITS, CostModel(), threshold_tokens=64)
    assert plan is not None and (plan.plan, plan.reason) == ("decode-local", "fork")
    plan = choose_shared(_inputs(kind="parallel"), LIMITS, CostModel(), threshold_tokens=64)
    assert plan is not None and plan.reason == "parallel"


@pytest.mark.parametrize(
    ("overrides", "limits", "threshold"),
    [
        # Shares less than the reuse threshold: not worth a plan of its own.
        ({"covered_tokens": 63, "prompt_tokens": 500}, LIMITS, 64),
        # The suffix past what it shares is longer than a holder may prefill itself.
        ({"prompt_tokens": 4_096 + 2_049}, LIMITS, 64),
        # The holder is serving as many requests as a local prefill may join.
        ({"holder_running": 8}, LIMITS, 64),
        # Decode-local turns are off.
        ({}, LocalLimits(enabled=False), 64),
    ],
)
def test_shared_kv_is_not_used_past_the_bounds_of_a_local_prefill(
    overrides: dict[str, Any], limits: LocalLimits, threshold: int
) -> None:
    assert choose_shared(_inputs(**overrides), limits, CostModel(), threshold) is None


def test_shared_kv_is_not_used_where_plain_pd_is_cheaper() -> None:
    """A local prefill on a decode serving seven streams delays each of them: past the cost
    of recomputing the whole prompt in P/D, the turn goes there (where prefill's own prefix
    cache may serve the shared start as well)."""
    costs = CostModel()
    busy = _inputs(prompt_tokens=1_200, covered_tokens=256, holder_running=7)
    assert choose_shared(busy, LIMITS, costs, 64) is None
    assert choose_shared(_inputs(prompt_tokens=1_200, covered_tokens=256), LIMITS, costs, 64)


def test_what_the_index_keeps_of_a_turn_travels_whole() -> None:
    turn = Indexed("c-key", "conversation ✓", 3, "http://decode-1:8000", "ab" * 12, 2048)
    assert Indexed.decode(turn.encode()) == turn
    # Written before the reply's KV was known (a mark): no location, no digest.
    assert Indexed.decode(Indexed("k", "c", 1).encode()) == Indexed("k", "c", 1)
    # An entry written by an older gateway (key and id alone) still finds its conversation.
    assert Indexed.decode(b'["k", "c"]') == Indexed("k", "c")


@pytest.fixture
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _post(url: str, messages: list[dict[str, Any]], **headers: str) -> httpx.Response:
    body = {"model": "fake", "messages": messages}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response


def _reply(response: httpx.Response) -> dict[str, Any]:
    return dict(response.json()["choices"][0]["message"])


def _recorded(store: Any, key: str, turn: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        entry = store.peek(key)
        if entry is not None and entry.recorded_turn >= turn and entry.holder_url is not None:
            return
        assert time.monotonic() < deadline, f"turn {turn} never recorded"
        time.sleep(0.02)


def test_a_request_without_id_that_extends_an_older_turn_forks_and_leaves_the_parent(
    fake_url: str,
) -> None:
    """Before, such a request took the conversation's KV (and recorded its own over it), so
    the parent's next turn found nothing it could reuse."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        store = gateway.app.state.gateway.store
        messages = [{"role": "user", "content": "plan the trip"}]
        first = _post(gateway.url, messages)
        parent = first.headers["x-conversation-id"]
        key = scoped_key("", parent)
        _recorded(store, key, 1)
        turn1 = [*messages, _reply(first)]
        second = _post(gateway.url, [*turn1, {"role": "user", "content": "and the hotel?"}])
        assert second.headers["x-conversation-id"] == parent
        _recorded(store, key, 2)
        held = store.peek(key).holder_request_id
        # A subagent starts from turn 1's context, after the parent moved on to turn 2.
        fork = _post(gateway.url, [*turn1, {"role": "user", "content": "subagent: trains"}])
        assert fork.headers["x-conversation-id"] not in (parent, "")
        assert store.peek(key).holder_request_id == held
        assert store.peek(key).turns == 2
        # The parent's turn 3 continues on its own KV.
        history = [*turn1, {"role": "user", "content": "and the hotel?"}, _reply(second)]
        third = _post(gateway.url, [*history, {"role": "user", "content": "book it"}])
        assert third.headers["x-conversation-id"] == parent
        assert third.headers["x-kvturn-plan"] == "decode-local"
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'kvturn_implicit_conversations_total{result="forked"} 1.0' in metrics


@pytest.mark.parametrize("shared", [True, False])
def test_turns_with_an_id_are_indexed_for_their_forks_unless_sharing_is_off(
    fake_url: str, shared: bool
) -> None:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        shared_prefixes=shared,
    )
    with running_gateway(config) as gateway:
        store = gateway.app.state.gateway.store
        # Long enough that its KV has a verified prefix to share (whole 16-token digest chunks).
        messages = [{"role": "user", "content": "Plan a week in Lisbon: flights, hotel, trains."}]
        response = _post(gateway.url, messages, **{"X-Session-ID": "s"})
        _recorded(store, scoped_key("", "s"), 1)
        time.sleep(0.1)  # the record indexes in the same step; nothing comes after it
        assert store.implicit.size() == (1 if shared else 0), response.headers


def test_a_request_without_id_never_continues_a_named_conversation(fake_url: str) -> None:
    """A named conversation's turns are indexed apart (by their messages alone): a request
    without an id that extends one is a conversation of its own, and the named one's KV
    stays where it was, for its own next turn."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        store = gateway.app.state.gateway.store
        key = scoped_key("", "named")
        messages = [{"role": "user", "content": "plan the trip"}]
        first = _post(gateway.url, messages, **{"X-Conversation-Id": "named"})
        _recorded(store, key, 1)
        held = store.peek(key).holder_request_id
        anonymous = _post(gateway.url, [*messages, _reply(first), {"role": "user", "content": "?"}])
        assert anonymous.headers["x-conversation-id"].startswith("implicit-")
        assert (store.peek(key).turns, store.peek(key).holder_request_id) == (1, held)
