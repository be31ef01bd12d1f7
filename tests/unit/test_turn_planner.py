"""The turn planner's branches, its learned costs, and implicit conversations (pure code)."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kvturn.gateway.digests import (
    ReplyCollector,
    extend,
    message_digests,
    reply_message,
    salt_digest,
    seed,
)
from kvturn.gateway.planner import (
    PRIOR_LOCAL,
    CostModel,
    LinearCost,
    LocalLimits,
    ReuseInputs,
    choose_reuse,
    plan_turn,
)
from kvturn.gateway.state.implicit import ImplicitIndex, Indexed
from kvturn.gateway.state.redis_client import RedisState
from kvturn.gateway.state.table import fresh_turn
from kvturn.gateway.state.table_in_process import ConversationStore
from kvturn.gateway.state.table_redis import RedisConversations
from kvturn.gateway.tokens import CHAT_PATH
from kvturn.gateway.turns.model import Turn
from kvturn.wire import last_prefix_digest, prefix_digests
from tests.gateway_fixtures import RedisServer, running_redis

HOLDER = "http://decode-0"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


PREFILL = "http://prefill-0"


def _inputs(**changes: object) -> ReuseInputs:
    base: dict[str, object] = {
        "held_tokens": 4000,
        "prompt_tokens": 4200,
        "prefix_matches": True,
        "covered_tokens": 3984,
        "holder_running": 0,
        "holder_url": HOLDER,
        "prefill_url": PREFILL,
    }
    base.update(changes)
    return ReuseInputs(**base)  # type: ignore[arg-type]


def _choose(limits: LocalLimits | None = None, costs: CostModel | None = None, **changes: object):
    return choose_reuse(_inputs(**changes), limits or LocalLimits(), costs or CostModel())


# ---- choose_reuse: one test per branch ----------------------------------------------------------


def test_costs_not_yet_learned_short_suffix_continues_on_the_holder() -> None:
    # Priors only (no turn observed yet): a 200-token tool result on a 4k history.
    plan = _choose()
    assert (plan.plan, plan.reason) == ("decode-local", "cheaper")
    costs = CostModel()
    assert costs.local_seconds(HOLDER, 200) < costs.pull_seconds(PREFILL, 4000, 200)


def test_suffix_too_long_for_a_local_prefill_goes_to_pd() -> None:
    limits = LocalLimits(max_suffix_tokens=512)
    assert _choose(limits, prompt_tokens=3984 + 512).plan == "decode-local"
    plan = _choose(limits, prompt_tokens=3984 + 513)
    assert (plan.plan, plan.reason) == ("pull-reuse", "suffix-too-long")


def test_holder_overloaded_goes_to_pd() -> None:
    plan = _choose(LocalLimits(max_running=4), holder_running=4)
    assert (plan.plan, plan.reason) == ("pull-reuse", "holder-busy")


def test_stall_on_the_holders_streams_tips_a_long_suffix_to_pd() -> None:
    # A 1,500-token local prefill is cheap for this turn alone, but delays every stream the
    # holder is decoding: with three of them, P/D is cheaper overall (the stall budget aside:
    # the tests below).
    unbudgeted = LocalLimits(stall_budget_s=math.inf)
    assert _choose(unbudgeted, prompt_tokens=5500, holder_running=0).plan == "decode-local"
    plan = _choose(unbudgeted, prompt_tokens=5500, holder_running=3)
    assert (plan.plan, plan.reason) == ("pull-reuse", "cheaper")
    # Without the stall term the same turn stays local.
    no_weight = LocalLimits(stall_weight=0, stall_budget_s=math.inf)
    assert _choose(no_weight, prompt_tokens=5500, holder_running=3).local


def test_a_suffix_that_would_stall_the_holders_streams_past_the_budget_is_pulled() -> None:
    # Priors: 1.5e-4 s a token, so a 216-token suffix is ~32 ms of compute inside one of the
    # holder's decode steps.
    costs = CostModel()
    assert costs.local_stall_seconds(HOLDER, 216) == pytest.approx(216 * 1.5e-4)
    # An idle holder stalls nobody: local, whatever the budget.
    assert _choose(LocalLimits(stall_budget_s=0.0), holder_running=0).local
    # One stream decoding there: past the budget, the suffix is computed on prefill.
    plan = _choose(LocalLimits(stall_budget_s=0.03), holder_running=1)
    assert (plan.plan, plan.reason) == ("pull-reuse", "streams-budget")
    assert _choose(LocalLimits(stall_budget_s=0.033), holder_running=1).local
    # A short suffix fits a 5 ms budget (~33 tokens by the priors); by default there is none.
    five_ms = LocalLimits(stall_budget_s=0.005)
    assert _choose(five_ms, prompt_tokens=3984 + 30, holder_running=2).local
    assert _choose(five_ms, prompt_tokens=3984 + 40, holder_running=2).reason == "streams-budget"
    assert _choose(prompt_tokens=3984 + 40, holder_running=2).local


def test_the_stall_is_the_holders_learned_per_token_cost_not_its_fixed_cost() -> None:
    costs = CostModel()
    # A holder whose local turns take 50 ms of hop and queueing, 0.1 ms a token.
    for suffix in (100, 300, 600, 900, 200, 1100, 50, 700) * 5:
        costs.observe_local(HOLDER, suffix, 0.05 + suffix * 1e-4)
    assert costs.local_stall_seconds(HOLDER, 100) == pytest.approx(0.01, rel=0.05)
    assert costs.local_seconds(HOLDER, 100) == pytest.approx(0.06, rel=0.05)


def test_edited_history_pulls_what_still_matches() -> None:
    plan = _choose(prefix_matches=False)
    assert (plan.plan, plan.reason) == ("pull-reuse", "history-edited")


def test_unknown_counts_and_local_off_pull() -> None:
    assert _choose(prompt_tokens=None).reason == "reuse"
    assert _choose(prefix_matches=None).reason == "reuse"
    plan = _choose(LocalLimits(enabled=False))
    assert (plan.plan, plan.reason) == ("pull-reuse", "local-off")


def test_learned_costs_decide_a_slow_holder_loses_to_pd() -> None:
    costs = CostModel()
    # The holder turns out slow at prefill (a busy GPU, a smaller one): 1 ms a token.
    for suffix in (100, 300, 600, 900, 200, 1100):
        costs.observe_local(HOLDER, suffix, 0.02 + suffix * 1e-3)
    # Prefill is fast, and pulls are cheap.
    for tokens in (500, 1000, 2000, 4000):
        costs.observe_prefill(PREFILL, tokens, 0, 0.01 + tokens * 2e-5)
    plan = choose_reuse(_inputs(prompt_tokens=4400), LocalLimits(), costs)
    assert (plan.plan, plan.reason) == ("pull-reuse", "cheaper")
    assert choose_reuse(_inputs(prompt_tokens=4010), LocalLimits(), costs).local


def test_a_local_prefill_a_little_slower_than_a_pull_stays_local() -> None:
    """Learned costs a few percent apart (noise, on one host) must not flip the plan: local is
    kept until a pull is predicted more than ``preference`` faster."""
    costs = CostModel()
    suffix = 4200 - 3984
    for _ in range(60):
        costs.observe_prefill(PREFILL, suffix, 4000, 0.2)
    pull = costs.pull_seconds(PREFILL, 4000, suffix)
    for _ in range(60):  # the holder's local prefill: learned 10% slower than the whole pull
        costs.observe_local(HOLDER, suffix, pull * 1.1)
    local = costs.local_seconds(HOLDER, suffix, PREFILL)
    assert pull < local <= pull * 1.25, (pull, local)
    assert _choose(costs=costs).plan == "decode-local"
    plan = _choose(LocalLimits(preference=0.0), costs=costs)
    assert (plan.plan, plan.reason) == ("pull-reuse", "cheaper")
    # Far slower (twice the pull) is not "a little".
    for _ in range(60):
        costs.observe_local(HOLDER, suffix, pull * 2)
    assert _choose(costs=costs).plan == "pull-reuse"


# ---- plan_turn: whether there is anything to reuse -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_about_to_expire_and_holder_gone_recompute() -> None:
    clock = Clock()
    store = ConversationStore(10, clock=clock)
    conversation = store.get_or_create("c")
    store.record_retained(conversation, HOLDER, "r1", 4000, lease_expires_in_s=10)

    def reason(healthy: bool = True) -> str:
        return plan_turn(
            conversation, clock(), holder_healthy=healthy, expiry_margin_s=0.5,
            threshold_tokens=64,
        ).reason  # fmt: skip

    assert reason() == "reuse"
    assert reason(healthy=False) == "holder-unhealthy"
    clock.now += 9.6  # 0.4 s left: inside the margin
    assert reason() == "lease-expired"


# ---- learned costs -------------------------------------------------------------------------------


def test_linear_cost_starts_at_its_prior_and_learns_the_engine() -> None:
    cost = LinearCost(*PRIOR_LOCAL)
    assert cost.coefficients() == pytest.approx(PRIOR_LOCAL)
    rng = random.Random(7)
    for _ in range(60):
        tokens = rng.randrange(50, 3000)
        cost.observe(tokens, 0.004 + tokens * 4e-4 + rng.uniform(-1e-3, 1e-3))
    fixed, per_token = cost.coefficients()
    assert per_token == pytest.approx(4e-4, rel=0.05)
    assert fixed == pytest.approx(0.004, abs=0.003)
    # Nonsense observations are ignored.
    cost.observe(100, float("nan"))
    cost.observe(100, -1.0)
    assert cost.coefficients() == (fixed, per_token)


def test_pull_cost_is_learned_from_what_a_pull_adds_to_prefill() -> None:
    costs = CostModel()
    for tokens in (256, 1024, 4096):
        costs.observe_prefill(PREFILL, tokens, 0, 0.01 + tokens * 1e-4)
    for held in (1000, 4000, 8000):
        # 200 computed tokens plus 5 us a pulled token.
        costs.observe_prefill(PREFILL, 200, held, 0.01 + 200 * 1e-4 + held * 5e-6)
    # Three observations: too few to tell a per-token cost from a fixed one; the prior's
    # per-token cost (1 us) holds.
    learned = costs.pull.predict(8000) - costs.pull.predict(0)
    assert learned == pytest.approx(0.008)
    for _ in range(4):
        for held in (1000, 4000, 8000):
            costs.observe_prefill(PREFILL, 200, held, 0.01 + 200 * 1e-4 + held * 5e-6)
    # More observations: closer to what they show (prefill's own fit is still part prior, so
    # the residual a pull adds is not exact).
    assert 0.025 < costs.pull.predict(8000) - costs.pull.predict(0) < 0.045
    snapshot = costs.snapshot()
    assert set(snapshot) == {"prefill", "local", "pull", "handoff"}
    assert snapshot["prefill"][PREFILL]["observations"] == 3  # type: ignore[index]
    assert snapshot["pull"]["observations"] == 15  # type: ignore[index]


# ---- exact-prefix digest the gateway keeps ----------------------------------------------------


def test_last_prefix_digest_is_the_holders_last_digest() -> None:
    rng = random.Random(3)
    held = [rng.randrange(50_000) for _ in range(1000)]
    digests = prefix_digests(held)
    covered = len(digests) * 16
    prompt = held + [rng.randrange(50_000) for _ in range(300)]
    assert last_prefix_digest(prompt, covered) == digests[-1]
    edited = list(prompt)
    edited[500] += 1
    assert last_prefix_digest(edited, covered) != digests[-1]
    assert last_prefix_digest(held[:100], covered) is None  # shorter than what is held
    assert last_prefix_digest(prompt, 8) is None  # covers no full chunk


# ---- implicit conversations -----------------------------------------------------------------


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_a_resent_history_finds_its_conversation_whatever_the_client_reformatted(
    where: str, request: pytest.FixtureRequest
) -> None:
    table: Any = ConversationStore(100)
    redis = None
    if where == "redis":
        server = request.getfixturevalue("redis_server")
        redis = RedisState(server.url, timeout_s=0.5, prefix=f"t{uuid.uuid4().hex}:")
        table = RedisConversations(redis, idle_s=60)
    index = table.implicit
    s = seed("tenant", "tiny")
    turn1 = [SYSTEM, USER]
    # Indexed as the gateway indexes a new conversation's streamed turn: by the mark that
    # makes its entry, as the reply ends.
    first = fresh_turn("key-1", "implicit-1")
    findable = (extend(message_digests(s, turn1)[-1], CALL), Indexed("key-1", "implicit-1"))
    marking = table.settling("key-1", first.turn, first.conversation, findable)
    if marking is not None:
        await marking
    # The framework echoes the reply back with another call id, "" for None, the arguments
    # re-serialised, and SDK-only fields.
    echoed = {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_other",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    }
    turn2 = [*turn1, echoed, {"role": "tool", "tool_call_id": "call_other", "content": "22C"}]
    assert await index.match(message_digests(s, turn2)) == Indexed("key-1", "implicit-1")
    # Another tenant, another model, or a changed message: no match.
    assert await index.match(message_digests(seed("other", "tiny"), turn2)) is None
    assert await index.match(message_digests(seed("tenant", "big"), turn2)) is None
    changed = [SYSTEM, {"role": "user", "content": "Weather in Rome?"}, *turn2[2:]]
    assert await index.match(message_digests(s, changed)) is None
    if redis is not None:
        await redis.close()


async def test_branches_of_a_conversation_both_find_it_and_the_index_is_bounded() -> None:
    index = ImplicitIndex(3)
    s = seed("", "tiny")
    reply = {"role": "assistant", "content": "Hello."}
    base = [USER]
    index.put(extend(message_digests(s, base)[-1], reply), ("k", "c"))
    left = [*base, reply, {"role": "user", "content": "left"}]
    right = [*base, reply, {"role": "user", "content": "right"}]
    assert await index.match(message_digests(s, left)) == ("k", "c")
    assert await index.match(message_digests(s, right)) == ("k", "c")
    for i in range(3):
        index.put(bytes([i]) * 16, (f"k{i}", f"c{i}"))
    assert index.size() == 3
    assert await index.match(message_digests(s, left)) is None  # the oldest entry went


def test_reply_collector_rebuilds_a_streamed_reply() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "check."}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "x",
                                "function": {"name": "weather", "arguments": ""},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
                    },
                }
            ]
        },
    ]
    raw = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    collector = ReplyCollector()
    # Chunk boundaries fall anywhere: split the byte stream at odd places.
    for start in range(0, len(raw), 37):
        collector.feed(raw[start : start + 37])
    message = collector.message()
    assert message is not None
    assert message["content"] == "Let me check."
    assert message["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    twice = ReplyCollector()
    twice.feed(b'data: {"choices":[{"index":1,"delta":{"content":"b"}}]}\n\n')
    assert twice.message() is None  # n > 1: not recorded
    assert reply_message({"choices": [{"message": {"role": "assistant", "content": "x"}}]})
    assert reply_message({"choices": []}) is None


async def test_a_changed_cache_salt_never_reuses() -> None:
    # A turn hashes its cache salt once, as it is made; planning and recording read it.
    assert Turn(CHAT_PATH, {"cache_salt": "alpha"}, None).salt == salt_digest("alpha")
    assert Turn(CHAT_PATH, {}, None).salt is None
    store = ConversationStore(10, clock=Clock())
    conversation = store.get_or_create("c")
    store.record_retained(
        conversation, HOLDER, "r1", 4000, lease_expires_in_s=30, held_salt=salt_digest("alpha")
    )

    def reason(salt: object) -> str:
        return plan_turn(
            conversation, store.clock(), holder_healthy=True, expiry_margin_s=0.5,
            threshold_tokens=64, salt=salt_digest(salt),
        ).reason  # fmt: skip

    assert reason("alpha") == "reuse"
    assert reason("beta") == "cache-salt-changed"
    assert reason(None) == "cache-salt-changed"
    # Implicit conversations: another salt is another conversation.
    index = ImplicitIndex(10)
    turn = [USER, {"role": "assistant", "content": "Sunny."}]
    index.put(message_digests(seed("", "tiny", "alpha"), turn)[-1], ("k", "c"))
    resent = [*turn, {"role": "user", "content": "And tomorrow?"}]
    assert await index.match(message_digests(seed("", "tiny", "alpha"), resent)) == ("k", "c")
    assert await index.match(message_digests(seed("", "tiny", "beta"), resent)) is None
