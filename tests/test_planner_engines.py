"""The turn planner on real engines: decode-local turns, the choice between plans, and reuse
for clients that send no conversation id.

Each reusing turn is checked against what cannot be faked: its answer, as token ids, equals one
engine alone with a fresh cache salt; NIXL's own transfer counters say whether KV moved (a
``decode-local`` turn moves none, a pull moves the history); decode's prefix-cache count says
how much of a local turn's prompt it served.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests.conftest import LocalPair
from tests.engine_requests import (
    KV_BYTES_PER_TOKEN,
    NixlReads,
    chat,
    long_prompt,
    metric_total,
    single_engine_completion_ids,
    single_engine_ids,
)
from tests.gateway_fixtures import TurnResult, metric, run_turn, running_gateway, wait_recorded

pytestmark = pytest.mark.engines

MAX_TOKENS = 16


def _config(pair: LocalPair, **overrides: Any) -> GatewayConfig:
    """The gateway's defaults (decode-local and implicit conversations on) on the pair, but
    for the cost margin: a pull must be predicted twice as fast to win. These tests are about
    what each plan does; on one host the two cost within noise of each other (measured), and
    the choice between them by cost has its own unit tests."""
    settings: dict[str, Any] = {"local_preference": 1.0, **overrides}
    return GatewayConfig(
        prefill=endpoints([pair.prefill_url]),
        decode=endpoints([pair.decode_url], [pair.decode_control_url]),
        control_secret=pair.control_secret,
        **settings,
    )


@pytest.fixture(scope="module")
def gateway(local_pair: LocalPair) -> Iterator[GatewayThread]:
    with running_gateway(_config(local_pair)) as running:
        yield running


def _client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=300)


def _opening(topic: str, tokens: int = 1500) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful agent that uses tools."},
        {"role": "user", "content": long_prompt(tokens, f"{topic} {uuid.uuid4().hex[:6]}")},
    ]


def _next(messages: list[dict[str, Any]], reply: TurnResult, turn: int) -> list[dict[str, Any]]:
    tool = {"role": "tool", "content": f"result {turn}: " + "the sensor reads 42. " * 12}
    return [*messages, {"role": "assistant", "content": reply.text}, tool]


def _assert_same_answer(
    pair: LocalPair, got: TurnResult, messages: list[dict[str, Any]], **extra: Any
) -> None:
    want = single_engine_ids(pair.prefill_url, pair.model, messages, MAX_TOKENS, **extra)
    first = next(
        (i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b), None
    )
    assert got.token_ids == want, f"the answer differs from one engine alone (at token {first})"


class Transfers:
    """NIXL reads on both engines since it was made. vLLM publishes transfer counts on a
    logging tick: :meth:`settle` runs one plain P/D turn (exactly one read, by decode) and waits
    for it to show, so every read before it has shown too."""

    def __init__(self, pair: LocalPair, gateway: GatewayThread) -> None:
        self.pair, self.gateway = pair, gateway
        self.prefill = NixlReads(pair.prefill_url)
        self.decode = NixlReads(pair.decode_url)

    def settle(self) -> tuple[float, float]:
        """(prefill reads, decode reads) since construction, not counting the canary's."""
        canary = [{"role": "user", "content": long_prompt(300, f"canary {uuid.uuid4()}")}]
        conversation = f"canary-{uuid.uuid4().hex[:8]}"
        run_turn(_client(self.gateway), self.pair.model, canary, conversation)
        self.decode.wait_for(1)
        _release(self.gateway, conversation)
        prefill_count, _ = self.prefill._read()
        decode_count, _ = self.decode._read()
        return prefill_count - self.prefill.count, decode_count - self.decode.count - 1


def _release(gateway: GatewayThread, conversation: str) -> None:
    httpx.delete(f"{gateway.url}/v1/kvturn/conversations/{conversation}").raise_for_status()


def _blocks_held(pair: LocalPair) -> int:
    stats = httpx.get(
        pair.decode_control_url + "/kvturn/leases", headers=pair.control_headers, timeout=10
    ).json()
    return int(stats["blocks_held"])


def _decode_local_turns(pair: LocalPair, gateway: GatewayThread, stream: bool) -> list[TurnResult]:
    client = _client(gateway)
    conversation = f"local-{uuid.uuid4().hex[:8]}"
    messages = _opening(f"river deltas {stream}")
    held_before = _blocks_held(pair)
    transfers = Transfers(pair, gateway)
    first = run_turn(client, pair.model, messages, conversation, stream=stream)
    assert first.plan == "recompute"
    wait_recorded(gateway, conversation)
    results = []
    for turn in range(3):
        messages = _next(messages, results[-1] if results else first, turn)
        got = run_turn(client, pair.model, messages, conversation, stream=stream)
        assert got.plan == "decode-local", (turn, got.plan, got.reason)
        _assert_same_answer(pair, got, messages)
        wait_recorded(gateway, conversation)
        results.append(got)
    results.insert(0, first)
    # Decode read the first turn's prompt from prefill; not a byte of KV moved after that.
    assert transfers.settle() == (0, 1)
    # Released, the conversation's blocks go back: a local turn's lease is freed like any.
    _release(gateway, conversation)
    deadline = time.monotonic() + 30
    while _blocks_held(pair) > held_before:
        assert time.monotonic() < deadline, (_blocks_held(pair), held_before)
        time.sleep(0.2)
    return results


@pytest.mark.parametrize("stream", [True, False])
def test_decode_local_turns_move_no_kv_and_answer_as_one_engine(
    local_pair: LocalPair, stream: bool
) -> None:
    leases_before = _lease_events(local_pair)
    # A gateway of its own: its costs are learned from this conversation alone.
    with running_gateway(_config(local_pair)) as gateway:
        turns = _decode_local_turns(local_pair, gateway, stream)
        text = httpx.get(gateway.url + "/metrics").text
        moved = metric(gateway.url + "/metrics", 'kvturn_kv_bytes_moved_total{plan="decode-local"}')
    # The holder's prefix cache served everything before the new suffix, in whole KV blocks
    # (vLLM-CPU's hold 128 tokens): as the engine counted it (a non-streamed reply's usage),
    # or as the gateway verified it before the stream began (the previous prompt but its last
    # few tokens, which appended text may merge with: a block less where those straddle one).
    slack = 2 * 128 if stream else 128
    for previous, got in itertools.pairwise(turns):
        assert got.reused_tokens >= previous.prompt_tokens - slack, (got, previous.prompt_tokens)
    # Each local turn's KV was retained as the conversation's new lease, superseding the last.
    events = _lease_events(local_pair)
    assert len(turns) == 4
    assert events["retained"] - leases_before["retained"] >= 3
    assert events["ended_superseded"] - leases_before["ended_superseded"] >= 3
    assert 'kvturn_turn_plans_total{plan="decode-local",reason="cheaper"} 3.0' in text
    assert moved == 0
    # The P/D turn's bytes were counted (the tiny model's KV per token, as decode publishes it).
    assert 'kvturn_kv_bytes_moved_total{plan="recompute"} 0.0' not in text


def _lease_events(pair: LocalPair) -> dict[str, float]:
    stats = httpx.get(
        pair.decode_control_url + "/kvturn/leases", headers=pair.control_headers, timeout=10
    ).json()
    return {
        "retained": float(stats["retained"]),
        "ended_superseded": float((stats.get("ended") or {}).get("superseded", 0)),
    }


def test_a_long_suffix_or_an_edited_history_goes_to_pd(local_pair: LocalPair) -> None:
    with running_gateway(_config(local_pair, max_local_suffix_tokens=400)) as gateway:
        client = _client(gateway)
        conversation = f"plan-{uuid.uuid4().hex[:8]}"
        messages = _opening("tundra", 1200)
        first = run_turn(client, local_pair.model, messages, conversation)
        wait_recorded(gateway, conversation)
        reads = NixlReads(local_pair.prefill_url)
        # A long document as the tool result: past the local bound, the history is pulled.
        messages = [
            *messages,
            {"role": "assistant", "content": first.text},
            {"role": "tool", "content": long_prompt(600, "a long tool result")},
        ]
        second = run_turn(client, local_pair.model, messages, conversation)
        assert second.plan == "pull-reuse"
        _assert_same_answer(local_pair, second, messages)
        reads.wait_for(1, min_bytes=second.reused_tokens * KV_BYTES_PER_TOKEN)
        wait_recorded(gateway, conversation)
        # The agent trims the long tool result: the holder's cache covers only what precedes
        # it, so the turn pulls that common prefix (verified on exact token ids) instead.
        edited = [*messages[:3], {"role": "tool", "content": "(trimmed)"}]
        edited.append({"role": "user", "content": "Sum up."})
        third = run_turn(client, local_pair.model, edited, conversation)
        _assert_same_answer(local_pair, third, edited)
        assert (third.plan, third.reason) == ("pull-reuse", "history-edited")
        assert 0 < third.reused_tokens < second.prompt_tokens
        plans = [
            line
            for line in httpx.get(gateway.url + "/metrics").text.splitlines()
            if line.startswith("kvturn_turn_plans_total")
        ]
        assert any('reason="suffix-too-long"' in line for line in plans), plans
        assert any('reason="history-edited"' in line for line in plans), plans


def _prompt_tokens_computed(url: str) -> float:
    """Prompt tokens an engine computed itself (vLLM's own count: not served from its prefix
    cache, not received over NIXL)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return metric_total(text, 'vllm:prompt_tokens_by_source_total{source="local_compute"')


def test_a_suffix_that_would_stall_the_holders_streams_is_computed_on_prefill(
    local_pair: LocalPair,
) -> None:
    """With a stall budget (``local_stall_budget_s``, off by default): while the holder decodes
    another conversation's stream, a turn whose suffix would stall that stream past it is
    pulled: prefill reads the history over NIXL and computes the suffix, decode computes none
    of it. With the holder idle, the same kind of turn continues there and no KV moves."""
    pair = local_pair
    with running_gateway(_config(pair, local_stall_budget_s=0.005)) as gateway:
        client = _client(gateway)
        conversation = f"budget-{uuid.uuid4().hex[:8]}"
        messages = _opening("moraines", 1500)
        first = run_turn(client, pair.model, messages, conversation)
        wait_recorded(gateway, conversation)
        # Another conversation's long reply, decoding on the same (only) decode engine.
        other = _opening("cirques", 300)
        decoding, done = threading.Event(), threading.Event()

        def stream_other() -> None:
            reply = client.chat.completions.create(
                model=pair.model, messages=other, max_tokens=600, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in reply:
                decoding.set()
            done.set()

        streamer = threading.Thread(target=stream_other, daemon=True)
        streamer.start()
        assert decoding.wait(60)
        assert not done.is_set()
        reads = NixlReads(pair.prefill_url)
        decode_computed = _prompt_tokens_computed(pair.decode_url)
        messages = _next(messages, first, 0)  # a ~250-token tool result: ~40 ms of compute
        second = run_turn(client, pair.model, messages, conversation)
        assert not done.is_set(), "the other stream ended before the turn was planned"
        assert (second.plan, second.reason) == ("pull-reuse", "streams-budget")
        _assert_same_answer(pair, second, messages)
        # Engine-side: prefill read the held history from decode over NIXL...
        reads.wait_for(1, min_bytes=second.reused_tokens * KV_BYTES_PER_TOKEN)
        assert second.reused_tokens >= first.prompt_tokens - 2 * 128
        # ...and decode computed no more than a block of the new prompt (it received the
        # rest from prefill): the suffix ran on prefill, not inside the other stream's steps.
        suffix = second.prompt_tokens - first.prompt_tokens
        assert _prompt_tokens_computed(pair.decode_url) - decode_computed < min(128, suffix)
        streamer.join(120)
        assert done.is_set()
        wait_recorded(gateway, conversation)
        # The holder idle again: the next turn continues there, and no KV moves.
        transfers = Transfers(pair, gateway)
        messages = _next(messages, second, 1)
        third = run_turn(client, pair.model, messages, conversation)
        assert (third.plan, third.reason) == ("decode-local", "cheaper")
        _assert_same_answer(pair, third, messages)
        assert transfers.settle() == (0, 0)


def test_official_client_without_an_id_gets_reuse(
    local_pair: LocalPair, gateway: GatewayThread
) -> None:
    """No conversation id, no kvturn import: the gateway finds the conversation by its
    messages. Streamed and not, tool calls included; and a branch (two requests extending
    the same turn) answers correctly too."""
    client = _client(gateway)
    messages = _opening("implicit estuaries", 900)
    got = run_turn(client, local_pair.model, messages, stream=False)
    assert got.plan == "recompute"
    plans = []
    for turn in range(3):
        messages = _next(messages, got, turn)
        got = run_turn(client, local_pair.model, messages, stream=turn % 2 == 0)
        _assert_same_answer(local_pair, got, messages)
        plans.append(got.plan)
        assert got.reused_tokens > 800, (turn, got)
    assert all(plan in ("decode-local", "pull-reuse") for plan in plans), plans
    # Two branches off the last turn: both correct, whichever reuses.
    branches = [
        [*messages, {"role": "assistant", "content": got.text}, {"role": "user", "content": x}]
        for x in ("Left?", "Right?")
    ]
    for branch in branches:
        _assert_same_answer(local_pair, run_turn(client, local_pair.model, branch), branch)
    assert (
        metric(gateway.url + "/metrics", 'kvturn_implicit_conversations_total{result="matched"}')
        >= 4
    )


def test_langchain_stock_chat_openai_gets_reuse(
    local_pair: LocalPair, gateway: GatewayThread
) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=gateway.url + "/v1", api_key="-", model=local_pair.model, temperature=0,
        max_tokens=MAX_TOKENS, max_retries=0,
    )  # fmt: skip
    opening = _opening("langchain lagoons", 900)
    history: list[Any] = [SystemMessage(opening[0]["content"]), HumanMessage(opening[1]["content"])]
    as_dicts = list(opening)
    url = gateway.url + "/metrics"
    reusing_before = sum(
        metric(url, f'kvturn_turns_total{{plan="{plan}"}}')
        for plan in ("decode-local", "pull-reuse")
    )
    for turn in range(3):
        text = str(llm.invoke(history).content)
        # LangChain gives text, not token ids: compare with one engine alone's text.
        alone = chat(
            local_pair.prefill_url,
            {
                "model": local_pair.model, "messages": as_dicts, "max_tokens": MAX_TOKENS,
                "temperature": 0, "cache_salt": uuid.uuid4().hex,
            },
        )  # fmt: skip
        assert text == alone["choices"][0]["message"]["content"], turn
        history += [AIMessage(text), HumanMessage(f"And then? ({turn})")]
        as_dicts += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
    reusing = sum(
        metric(url, f'kvturn_turns_total{{plan="{plan}"}}')
        for plan in ("decode-local", "pull-reuse")
    )
    assert reusing - reusing_before == 2  # turns 2 and 3


def test_x_session_id_names_the_conversation(local_pair: LocalPair, gateway: GatewayThread) -> None:
    messages = _opening("session ids", 700)
    body = {"model": local_pair.model, "messages": messages, "max_tokens": 8, "temperature": 0}
    session = f"sess-{uuid.uuid4().hex[:8]}"
    first = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert first.headers["x-conversation-id"] == session
    wait_recorded(gateway, session)
    reply = first.json()["choices"][0]["message"]["content"]
    body["messages"] = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "More."},
    ]
    second = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert second.headers["x-kvturn-plan"] in ("decode-local", "pull-reuse")
    assert second.headers["x-kvturn-plan-reason"]


def test_completions_continue_on_the_holder(local_pair: LocalPair) -> None:
    with running_gateway(_config(local_pair)) as gateway:
        _completion_turns(local_pair, gateway)


def _completion_turns(local_pair: LocalPair, gateway: GatewayThread) -> None:
    client = _client(gateway)
    conversation = {"X-Conversation-Id": f"complete-local-{uuid.uuid4().hex[:8]}"}
    prompt = long_prompt(900, f"kites {uuid.uuid4().hex[:6]}")
    plans = []
    for turn in range(3):
        raw = client.completions.with_raw_response.create(
            model=local_pair.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_headers=conversation, extra_body={"return_token_ids": True},
        )  # fmt: skip
        completion = raw.parse()
        plans.append(raw.headers["x-kvturn-plan"])
        got = list(getattr(completion.choices[0], "token_ids", None) or [])
        assert got == single_engine_completion_ids(
            local_pair.prefill_url, local_pair.model, prompt, MAX_TOKENS
        ), f"turn {turn}: the answer differs from one engine alone"
        if turn:
            assert int(raw.headers["x-kvturn-reused-tokens"]) > 800
        wait_recorded(gateway, conversation["X-Conversation-Id"])
        prompt = prompt + completion.choices[0].text + f" Now the wind, part {turn}."
    assert plans == ["recompute", "decode-local", "decode-local"]


def _stop_string_in(text: str) -> str:
    """Two characters of ``text`` whose first occurrence starts after its first character: a
    stop string the reply is sure to hit once it has decoded something."""
    for start in range(1, len(text) - 1):
        candidate = text[start : start + 2]
        if text.find(candidate) == start and candidate.strip():
            return candidate
    raise AssertionError(f"no stop string in {text!r}")


def test_turns_ending_on_a_stop_string_keep_their_kv(
    local_pair: LocalPair, gateway: GatewayThread
) -> None:
    """vLLM's API server ends a turn on a stop string by aborting it in the engine, and
    NixlConnector keeps nothing of an aborted request; kvturn's connector retains it like a
    finished one, so the next turn reuses (before: it recomputed everything, "first-turn")."""
    client = _client(gateway)
    conversation = f"stops-{uuid.uuid4().hex[:8]}"
    messages = _opening("stop strings")
    held_before = _blocks_held(local_pair)
    previous: TurnResult | None = None
    for turn in range(3):
        if previous is not None:
            messages = _next(messages, previous, turn)
        unstopped = chat(local_pair.prefill_url, {
            "model": local_pair.model, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "cache_salt": uuid.uuid4().hex,
        })["choices"][0]["message"]["content"]  # fmt: skip
        stop = _stop_string_in(unstopped)
        got = run_turn(client, local_pair.model, messages, conversation, stop=[stop])
        assert got.finish_reason == "stop" and got.text == unstopped[: unstopped.find(stop)]
        if turn == 0:
            assert got.plan == "recompute"
        else:
            assert got.plan in ("pull-reuse", "decode-local"), (turn, got.plan, got.reason)
            assert got.reused_tokens > 1000, (turn, got)
        _assert_same_answer(local_pair, got, messages, stop=[stop])
        wait_recorded(gateway, conversation)
        previous = got
    # What the aborted turns left is a lease like any: released, every block comes back.
    _release(gateway, conversation)
    deadline = time.monotonic() + 30
    while _blocks_held(local_pair) > held_before:
        assert time.monotonic() < deadline, (_blocks_held(local_pair), held_before)
        time.sleep(0.2)
