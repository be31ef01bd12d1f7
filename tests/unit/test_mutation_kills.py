"""Tests written for mutants that survived the unit tests (issue 42; `make mutation`,
benchmarks/results/mutation.md): each pins a boundary or a value that no other unit test
checked exactly."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvturn.gateway.auth import ApiKeys, OperatorKeys, Unauthorized, scoped_key, tenant_salt
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.errors import InvalidRequest
from kvturn.gateway.planner import (
    PRIOR_LOCAL,
    PRIOR_PREFILL,
    REUSE,
    CostModel,
    LinearCost,
    LocalLimits,
    ReuseInputs,
    SharedInputs,
    TurnPlan,
    choose_reuse,
    choose_shared,
    plan_turn,
)
from kvturn.gateway.state.table import Conversation, Held, fresh_turn
from kvturn.gateway.state.table_in_process import ConversationStore
from kvturn.gateway.validation import MAX_N, _objects_with, check_request
from tests.gateway_fixtures import running_fake_engine, running_gateway
from tests.unit.test_gateway_app import _REPLY, _TOOL_RESULT, _recorded, _until

# ---- the planner's threshold -----------------------------------------------------------------


def _held(tokens: int) -> Conversation:
    conversation = Conversation("k", "c", turns=2)
    conversation.holder_url = "http://d"
    conversation.holder_request_id = "r1"
    conversation.held_tokens = tokens
    conversation.lease_expires_at = 100.0
    return conversation


@pytest.mark.parametrize(("held", "reason"), [(63, "below-threshold"), (64, "reuse")])
def test_a_holding_of_exactly_the_threshold_is_reused(held: int, reason: str) -> None:
    """``threshold_tokens`` is the smallest holding worth reusing, not the largest one that
    is not (``<``, not ``<=``)."""
    plan = plan_turn(
        _held(held), 0.0, holder_healthy=True, expiry_margin_s=5.0, threshold_tokens=64
    )
    assert plan.reason == reason
    assert (plan is REUSE) == (reason == "reuse")


@pytest.mark.parametrize(
    ("turns", "reason"), [(0, "first-turn"), (1, "first-turn"), (2, "nothing-held")]
)
def test_a_conversation_with_nothing_held_says_whether_it_just_began(
    turns: int, reason: str
) -> None:
    conversation = Conversation("k", "c", turns=turns)
    plan = plan_turn(
        conversation, 0.0, holder_healthy=True, expiry_margin_s=5.0, threshold_tokens=64
    )
    assert (plan.plan, plan.reason) == ("recompute", reason)


def test_every_reason_not_to_reuse_recomputes() -> None:
    def plan(
        conversation: Conversation, now: float = 0.0, salt: bytes | None = None
    ) -> tuple[str, str]:
        chosen = plan_turn(
            conversation, now, holder_healthy=True, expiry_margin_s=5.0, threshold_tokens=64,
            salt=salt,
        )  # fmt: skip
        return chosen.plan, chosen.reason

    assert plan(_held(1000), salt=b"other") == ("recompute", "cache-salt-changed")
    assert plan(_held(1000), now=96.0) == ("recompute", "lease-expired")
    assert plan(_held(63)) == ("recompute", "below-threshold")
    unhealthy = plan_turn(
        _held(1000), 0.0, holder_healthy=False, expiry_margin_s=5.0, threshold_tokens=64
    )
    assert (unhealthy.plan, unhealthy.reason) == ("recompute", "holder-unhealthy")
    assert plan(_held(1000)) == ("pull-reuse", "reuse")


# ---- the planner's choice and its costs ------------------------------------------------------


def _inputs(**change: Any) -> ReuseInputs:
    values: dict[str, Any] = dict(
        held_tokens=100, prompt_tokens=1100, prefix_matches=True, covered_tokens=100,
        holder_running=0, holder_url="http://d", prefill_url="http://p",
    )  # fmt: skip
    values.update(change)
    return ReuseInputs(**values)


class _Costs(CostModel):
    """Fixed costs: the choice's own arithmetic, nothing learned."""

    def __init__(self, local: float, pull: float) -> None:
        super().__init__()
        self.local_s, self.pull_s = local, pull

    def local_seconds(self, decode_url: str, suffix: int, prefill_url: str | None = None) -> float:
        return self.local_s

    def pull_seconds(self, prefill_url: str, held: int, suffix: int) -> float:
        return self.pull_s


def _fast_prefill(costs: CostModel, url: str = "http://p") -> None:
    """``url``'s prefill learns it computes 1 µs a token, no fixed cost (sizes that vary)."""
    for _ in range(8):
        for tokens in (1000, 2000, 3000, 4000, 5000):
            costs.observe_prefill(url, tokens, 0, tokens * 1e-6)


def test_a_one_token_suffix_is_within_a_one_token_limit() -> None:
    limits = LocalLimits(max_suffix_tokens=1)
    costs = _Costs(local=0.0, pull=1.0)
    for prompt in (100, 101):  # the last token, always computed; one more past the prefix
        plan = choose_reuse(_inputs(prompt_tokens=prompt), limits, costs)
        assert plan.reason == "cheaper", prompt
    assert choose_reuse(_inputs(prompt_tokens=102), limits, costs).reason == "suffix-too-long"


def test_a_local_prefill_exactly_at_the_preference_stays_local() -> None:
    limits = LocalLimits(preference=0.5)
    assert choose_reuse(_inputs(), limits, _Costs(local=3.0, pull=2.0)).plan == "decode-local"
    assert choose_reuse(_inputs(), limits, _Costs(local=3.5, pull=2.0)).plan == "pull-reuse"


def test_the_holder_computes_as_fast_as_the_prefill_it_would_pull_for() -> None:
    """Before the holder's own turns tell its speed, a local prefill is costed at the per-token
    speed learned on the turn's prefill engine (the same model), and so chosen: at the prior's
    speed (150 µs a token) the 1000-token suffix would cost more than a pull through that
    fast prefill."""
    costs = CostModel()
    _fast_prefill(costs)
    learned = costs.prefill["http://p"].coefficients()[1]
    assert learned < PRIOR_LOCAL[1] / 10
    local = costs.local_seconds("http://d", 1000, "http://p")
    assert local == pytest.approx(PRIOR_LOCAL[0] + 1000 * learned)
    assert costs.local_seconds("http://d", 1000) == pytest.approx(
        PRIOR_LOCAL[0] + 1000 * PRIOR_LOCAL[1]
    )
    assert costs.local_seconds("http://d", 1000, "http://other") == pytest.approx(
        PRIOR_LOCAL[0] + 1000 * PRIOR_LOCAL[1]
    )
    plan = choose_reuse(_inputs(), LocalLimits(), costs)
    assert plan.plan == "decode-local"
    # A decode serving one stream: the stall it suffers doubles the local cost, still cheaper
    # (with no budget on the stall itself; the budget has tests of its own).
    unbudgeted = LocalLimits(stall_budget_s=math.inf)
    assert choose_reuse(_inputs(holder_running=1), unbudgeted, costs).plan == "decode-local"


def test_a_pull_through_a_fast_prefill_beats_a_slow_holder() -> None:
    """The pull is costed on the turn's own prefill engine: one that computes fast makes the
    pull cheaper than a holder that takes 150 ms for the same suffix (at the prefill prior's
    speed the pull would cost more than that, and the turn would stay on the holder)."""
    costs = CostModel()
    _fast_prefill(costs)
    for _ in range(40):
        costs.observe_local("http://d", 1000, 0.15)
    local = costs.local_seconds("http://d", 1000, "http://p")
    assert local == pytest.approx(0.15, rel=0.05)
    assert costs.pull_seconds("http://p", 100, 1000) * 1.25 < local
    assert costs.pull_seconds("http://new", 100, 1000) * 1.25 > local
    assert choose_reuse(_inputs(), LocalLimits(), costs) == TurnPlan("pull-reuse", "cheaper")


def test_a_pull_costs_prefill_of_the_suffix_the_read_and_the_handoff() -> None:
    costs = CostModel()
    _fast_prefill(costs)
    fixed, per_token = costs.prefill["http://p"].coefficients()
    expected = (
        fixed + per_token * 1000  # the suffix, on the learned prefill
        + 0.020 + 1e-6 * 100  # reading the 100 held tokens (prior)
        + 0.020 + 1e-6 * 1100  # decode reading the whole prompt (prior)
    )  # fmt: skip
    assert costs.pull_seconds("http://p", 100, 1000) == pytest.approx(expected)
    # An engine never seen is costed at the prefill prior.
    assert costs.pull_seconds("http://new", 0, 1000) == pytest.approx(
        PRIOR_PREFILL[0] + PRIOR_PREFILL[1] * 1000 + 0.020 + 0.020 + 1e-6 * 1000
    )


def test_each_decode_learns_its_own_local_cost() -> None:
    costs = CostModel()
    for _ in range(10):
        costs.observe_local("http://slow", 100, 2.0)
    assert costs.local_seconds("http://slow", 100) > 1.0
    assert costs.local_seconds("http://other", 100) == pytest.approx(
        PRIOR_LOCAL[0] + 100 * PRIOR_LOCAL[1]
    )
    assert set(costs.local) == {"http://slow", "http://other"}


def _fitted(sizes: list[float], seconds: list[float], prior: tuple[float, float]) -> LinearCost:
    """A fit of exactly these observations: no forgetting, no blending with the prior."""
    cost = LinearCost(*prior, decay=1.0, prior_weight=0.0)
    for tokens, taken in zip(sizes, seconds, strict=True):
        cost.observe(tokens, taken)
    return cost


def test_a_slope_is_learned_from_five_turns_of_varied_sizes_not_four() -> None:
    sizes = [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    seconds = [0.01 + 1e-3 * tokens for tokens in sizes]
    prior = (0.5, 1e-4)
    fixed, per_token = _fitted(sizes, seconds, prior).coefficients()
    assert fixed == pytest.approx(0.01) and per_token == pytest.approx(1e-3)
    # Four turns: the prior's per-token cost stays, the fixed part is what is left over.
    fixed, per_token = _fitted(sizes[:4], seconds[:4], prior).coefficients()
    assert per_token == 1e-4 and fixed == pytest.approx(0.01 + 2500 * (1e-3 - 1e-4))


def test_sizes_too_alike_keep_the_priors_per_token_cost() -> None:
    sizes = [1000.0, 1010.0, 1020.0, 1030.0, 1040.0, 1050.0]  # 2% apart
    seconds = [0.5, 0.3, 0.7, 0.2, 0.9, 0.4]
    fixed, per_token = _fitted(sizes, seconds, (0.0, 1e-4)).coefficients()
    assert per_token == 1e-4
    assert fixed == pytest.approx(sum(seconds) / 6 - 1e-4 * sum(sizes) / 6)


def test_a_negative_fixed_cost_is_no_fixed_cost() -> None:
    sizes = [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    seconds = [1e-3 * tokens - 0.5 for tokens in sizes]  # a line that crosses below zero
    fixed, per_token = _fitted(sizes, seconds, (0.5, 1.0)).coefficients()
    assert fixed == 0.0
    assert per_token == pytest.approx(
        sum(t * s for t, s in zip(sizes, seconds, strict=True)) / sum(t * t for t in sizes)
    )


def test_the_prior_is_worth_three_observations() -> None:
    cost = LinearCost(0.0, 0.0)
    cost.observe(0, 1.0)  # one turn: a fixed second, where the prior said nothing
    assert cost.coefficients()[0] == pytest.approx(1 / (1 + 3.0 * 0.95))


def test_a_free_or_empty_observation_still_counts() -> None:
    cost = LinearCost(0.1, 1e-3)
    cost.observe(0, 0.0)  # nothing computed, no time: a real (if cheap) observation
    cost.observe(10, 0.0)
    cost.observe(0, 0.05)
    assert cost.observations == 3
    for tokens, seconds in ((-1, 0.1), (10, -0.1), (float("nan"), 0.1), (10, float("inf"))):
        cost.observe(tokens, seconds)
    assert cost.observations == 3


def test_a_pull_is_costed_at_what_it_adds_to_prefill() -> None:
    costs = CostModel()
    prefill = costs.prefill.setdefault("http://p", LinearCost(*PRIOR_PREFILL))
    computing = prefill.predict(100)
    costs.observe_prefill("http://p", 100, 1000, computing + 0.25)
    expected = LinearCost(0.020, 1e-6)  # the pull's prior
    expected.observe(1000, 0.25)
    assert costs.pull.coefficients() == pytest.approx(expected.coefficients())
    assert prefill.observations == 0  # a pull's round trip teaches nothing of computing


def test_observations_that_agree_with_the_prior_leave_it_as_it_was() -> None:
    cost = LinearCost(0.1, 1e-3)
    cost.observe(100, 0.2)  # 0.1 + 100 * 1e-3: exactly what the prior predicts
    fixed, per_token = cost.coefficients()
    assert fixed == pytest.approx(0.1) and per_token == pytest.approx(1e-3)


def test_sizes_that_vary_by_exactly_thirty_percent_teach_a_slope() -> None:
    sizes = [11.0, 17.0, 20.0, 23.0, 29.0]  # mean 20, standard deviation 6: exactly 30%
    seconds = [0.01 + 1e-3 * tokens for tokens in sizes]
    per_token = _fitted(sizes, seconds, (0.0, 1.0)).coefficients()[1]
    assert per_token == pytest.approx(1e-3)


def test_a_prediction_follows_the_prior_it_is_given() -> None:
    cost = LinearCost(0.010, 1e-4)
    assert cost.predict(100) == pytest.approx(0.020)
    assert cost.predict(100, (0.5, 0.0)) == pytest.approx(0.5)


def test_the_snapshot_reports_each_fit_in_milliseconds() -> None:
    costs = CostModel()
    costs.pull = LinearCost(0.0123456, 2.5e-7)
    costs.local["http://d"] = LinearCost(0.0011115, 1.23456e-7)
    costs.local["http://slow"] = LinearCost(0.0, 1e-3)  # 1 ms a token: 1000 ms per 1k
    snapshot = costs.snapshot()
    assert snapshot["pull"] == {"fixed_ms": 12.346, "per_1k_tokens_ms": 0.25, "observations": 0}
    assert snapshot["local"] == {
        "http://d": {"fixed_ms": 1.112, "per_1k_tokens_ms": 0.123, "observations": 0},
        "http://slow": {"fixed_ms": 0.0, "per_1k_tokens_ms": 1000.0, "observations": 0},
    }
    assert snapshot["prefill"] == {}
    assert snapshot["handoff"] == {"fixed_ms": 20.0, "per_1k_tokens_ms": 1.0, "observations": 0}


# ---- the conversation table -----------------------------------------------------------------


def test_kv_whose_lease_ends_at_the_margin_is_not_live() -> None:
    conversation = _held(1000)  # its lease ends at 100.0
    assert conversation.has_live_kv(94.9, 5.0)
    assert not conversation.has_live_kv(95.0, 5.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_renewal_says_the_seconds_left_and_marks_the_entry_used() -> None:
    clock = _Clock()
    store = ConversationStore(10, clock=clock)
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 500, lease_expires_in_s=30)
    clock.now += 7
    assert store.renew(conversation, 0.5) == 0.5
    assert conversation.last_seen == clock.now
    assert conversation.lease_expires_at == clock.now + 0.5
    assert store.renew(conversation, -2.0) == 0.0  # a lease already over: none left


async def test_a_turn_already_recorded_is_not_marked_settling_again() -> None:
    store = ConversationStore(10)
    taken = await store.take("c", "c", None)
    epoch, turn = taken.conversation.epoch, taken.turn
    held = Held("http://d", "r1", 500, 30.0)
    assert (await store.record("c", epoch, turn, held)).kept
    conversation = store.peek("c")
    assert conversation is not None and conversation.recorded_turn == turn
    for late in (turn - 1, turn):  # a mark arriving after its turn (or a later one) recorded
        store.settling("c", late)
        assert conversation.settling is None and conversation.settling_turn == 0
    store.settling("c", turn + 1)  # the next turn's reply is under way: its takers wait
    assert conversation.settling is not None and conversation.settling_turn == turn + 1


async def test_a_taken_entry_keeps_no_reference_to_the_kv() -> None:
    """What a turn takes comes off the table: the entry left holds nothing of the KV (as a
    new entry holds nothing), and the copy the turn gets shares no event with it."""
    store = ConversationStore(10)
    taken = await store.take("c", "c", None)
    held = Held("http://d", "r1", 500, 30.0, "ab" * 12, 480, b"salt", "mark")
    await store.record("c", taken.conversation.epoch, taken.turn, held)
    store.settling("c", taken.turn + 1)
    entry = store.peek("c")
    assert entry is not None and entry.holder_request_id == "r1"
    again = await store.take("c", "c", None)
    assert again.conversation.holder_request_id == "r1" and again.conversation.held_tokens == 500
    assert again.conversation.settling is None and entry.settling is not None
    empty = Conversation("c", "c")
    for name in (
        "holder_url", "holder_request_id", "held_tokens", "held_digest", "held_digest_tokens",
        "held_salt", "held_prompt_mark", "lease_expires_at",
    ):  # fmt: skip
        assert getattr(entry, name) == getattr(empty, name), name
        assert type(getattr(entry, name)) is type(getattr(empty, name)), name


async def test_a_take_waits_for_a_pending_record_only_when_asked() -> None:
    store = ConversationStore(10)
    taken = await store.take("c", "c", None)
    store.settling("c", taken.turn)
    # No wait asked (the default): the turn goes on at once, the mark still pending.
    second = await asyncio.wait_for(store.take("c", "c", None), 0.5)
    assert second.turn == taken.turn + 1


def test_every_retry_is_counted() -> None:
    store = ConversationStore(10)
    conversation = store.get_or_create("c")
    assert not store.note_turn(conversation, "t1")
    assert store.note_turn(conversation, "t1") and store.note_turn(conversation, "t1")
    assert conversation.retries == 2


async def test_live_leases_are_counted() -> None:
    clock = _Clock()
    store = ConversationStore(10, clock=clock)
    for i in range(5):
        conversation = store.get_or_create(f"c{i}")
        if i % 2 == 0:  # c0, c2, c4 hold a live lease
            store.record_retained(conversation, "http://d", f"r{i}", 100, lease_expires_in_s=30)
    assert await store.counts() == (5, 3)


async def test_records_are_fenced_by_turn_and_settle_only_their_own_mark() -> None:
    store = ConversationStore(10)
    first = await store.take("c", "c", None)
    second = await store.take("c", "c", None)
    epoch = first.conversation.epoch
    store.settling("c", second.turn)  # the second turn's reply is under way
    entry = store.peek("c")
    assert entry is not None and entry.settling_turn == second.turn
    # The first turn's record: kept (nothing newer is recorded yet); the second's mark stays.
    late = await store.record("c", epoch, first.turn, Held("http://d", "r1", 100, 30.0))
    assert late.kept is True
    assert entry.settling_turn == second.turn and entry.settling is not None
    recorded = await store.record("c", epoch, second.turn, Held("http://d", "r2", 200, 30.0))
    assert recorded.kept is True and recorded.replaced == ("http://d", "r1")
    assert entry.settling_turn == 0 and entry.settling is None
    # The same turn recorded again is still its turn; an older one is refused.
    again = await store.record("c", epoch, second.turn, Held("http://d", "r3", 300, 30.0))
    assert again.kept is True and again.replaced == ("http://d", "r2")
    refused = await store.record("c", epoch, first.turn, Held("http://d", "r4", 100, 30.0))
    assert refused.kept is False and entry.holder_request_id == "r3"
    # A record of nothing held is kept (there is nothing to free).
    nothing = await store.record("c", epoch, second.turn + 1, None)
    assert nothing.kept is True and nothing.replaced is None


def test_a_new_entry_is_seen_now_and_not_swept_as_idle() -> None:
    clock = _Clock()
    store = ConversationStore(10, clock=clock)
    assert store.get_or_create("c").last_seen == clock.now
    assert store.sweep(idle_s=60.0, budget=10) == 0 and len(store) == 1


def test_digest_tokens_count_only_with_their_digest() -> None:
    store = ConversationStore(10)
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 500, 30.0, None, 480)
    assert conversation.held_digest_tokens == 0  # no digest: nothing verified
    store.record_retained(conversation, "http://d", "r2", 500, 30.0, "ab" * 12)
    assert conversation.held_digest_tokens == 0  # a digest said to cover nothing
    store.record_retained(conversation, "http://d", "r3", 500, 30.0, "ab" * 12, 480)
    assert conversation.held_digest_tokens == 480


def test_a_fresh_turn_is_turn_one_and_no_retry() -> None:
    taken = fresh_turn("k", "c")
    assert (taken.turn, taken.conversation.turns, taken.fresh) == (1, 1, True)
    assert taken.retry is False


async def test_a_lease_ending_now_is_not_live() -> None:
    clock = _Clock()
    store = ConversationStore(10, clock=clock)
    store.record_retained(store.get_or_create("c"), "http://d", "r1", 100, lease_expires_in_s=0)
    assert await store.counts() == (1, 0)


async def test_each_heartbeat_lookup_is_counted_and_shares_no_event() -> None:
    store = ConversationStore(10)
    taken = await store.take("c", "c", None)
    store.settling("c", taken.turn)
    first = await store.lookup("c")
    second = await store.lookup("c")
    assert first is not None and second is not None and second.heartbeats == 2
    assert second.settling is None and store.peek("c").settling is not None  # type: ignore[union-attr]


def test_an_entry_idle_for_exactly_the_idle_time_with_a_lease_just_ended_is_swept() -> None:
    clock = _Clock()
    store = ConversationStore(10, clock=clock)
    store.record_retained(store.get_or_create("c"), "http://d", "r1", 100, lease_expires_in_s=30)
    clock.now += 30.0  # the lease ends now; the entry was last seen 30 s ago
    assert store.sweep(idle_s=30.0, budget=10) == 1 and len(store) == 0


# ---- auth: the keys' files and their errors ---------------------------------------------------

_KEY = "k" * 16


def test_a_comment_holding_a_hash_sign_is_still_a_comment() -> None:
    keys = ApiKeys.parse(f"{_KEY} alpha # the team's key # rotated 2026-01\n")
    assert keys.tenants == {"alpha"} and keys.tenant(f"Bearer {_KEY}") == "alpha"
    operators = OperatorKeys.parse(f"{_KEY} # ops # on call\n")
    operators.check(f"Bearer {_KEY}")


@pytest.mark.parametrize("line", [f"{_KEY} alpha beta", f"{_KEY}==alpha"])
def test_a_pair_with_more_than_one_separator_is_refused(line: str) -> None:
    """``key tenant`` or ``key=tenant``: a third word, or a doubled ``=``, makes no tenant name
    (never a key that ends in the first word, or a tenant after the second ``=``)."""
    with pytest.raises(ValueError, match="invalid tenant name"):
        ApiKeys.parse(line)


def test_a_key_without_a_tenant_says_how_to_write_one() -> None:
    with pytest.raises(ValueError) as refused:
        ApiKeys.parse(_KEY)
    assert str(refused.value) == "each API key needs a tenant: 'key tenant' or 'key=tenant'"


@pytest.mark.parametrize("authorization", [f"Bearer {'x' * 16}", f"Basic {_KEY}"])
def test_a_wrong_key_is_told_as_openai_tells_it(authorization: str) -> None:
    for check in (ApiKeys([(_KEY, "alpha")]).tenant, OperatorKeys([_KEY]).check):
        with pytest.raises(Unauthorized) as refused:
            check(authorization)
        assert refused.value.message == "Incorrect API key provided."
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"


def test_a_key_of_exactly_sixteen_characters_is_long_enough() -> None:
    assert ApiKeys([("k" * 16, "alpha")]).tenant("Bearer " + "k" * 16) == "alpha"
    OperatorKeys(["o" * 16]).check("Bearer " + "o" * 16)
    for make in (lambda: ApiKeys([("k" * 15, "alpha")]), lambda: OperatorKeys(["o" * 15])):
        with pytest.raises(ValueError) as refused:
            make()
        assert str(refused.value) == "API keys must be at least 16 characters long"


def test_a_caller_without_a_key_is_told_how_to_send_one() -> None:
    for check in (ApiKeys([(_KEY, "alpha")]).tenant, OperatorKeys([_KEY]).check):
        with pytest.raises(Unauthorized) as refused:
            check(None)
        assert refused.value.message == (
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        )


def test_spaces_after_the_scheme_are_not_part_of_the_key() -> None:
    assert ApiKeys([(_KEY, "alpha")]).tenant(f"Bearer   {_KEY}") == "alpha"
    OperatorKeys([_KEY]).check(f"bearer  {_KEY}")


def test_a_tenants_cache_salt_is_its_own_and_stable() -> None:
    alpha = tenant_salt("alpha", None)
    assert alpha is not None and alpha == tenant_salt("alpha", None)
    assert alpha != tenant_salt("beta", None)
    prefix, digest = alpha[: len("kvturn-t-")], alpha[len("kvturn-t-") :]
    assert prefix == "kvturn-t-" and len(digest) == 32 and int(digest, 16) >= 0
    # A client's own salt separates further; an empty or non-string one is no salt.
    assert tenant_salt("alpha", "mine") == f"{alpha}:mine"
    assert tenant_salt("alpha", "") == tenant_salt("alpha", 7) == alpha
    # An open gateway passes a client's string salt on as it came, and nothing else.
    assert tenant_salt("", "mine") == "mine"
    assert tenant_salt("", 7) is None and tenant_salt("", None) is None


def test_a_conversations_key_is_stable_across_releases() -> None:
    """The table (in Redis, shared by gateways of different releases in a rolling upgrade)
    and decode's leases name a conversation by this key: it must not change."""
    assert scoped_key("alpha", "chat-1") == "c-db4b47cc148458030cf68b503be1d023"
    assert scoped_key("", "chat-1") == "c-f94c86eb58b485e41445889072921907"


# ---- validation ----------------------------------------------------------------------------


def test_each_listed_item_must_be_an_object_with_a_string_key() -> None:
    check = _objects_with("role").func
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    assert check(messages) is messages  # checked in place, not copied
    assert check([]) == []
    for i, bad in enumerate(([], {"content": "x"}, {"role": 1}, "user")):
        items = [{"role": "user"}, bad]
        with pytest.raises(ValueError) as refused:
            check(items)
        assert str(refused.value) == "item 1 must be an object with a string 'role'", i


def test_a_body_that_is_no_object_is_named_body() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_request("/v1/chat/completions", [])  # type: ignore[arg-type]
    assert refused.value.param == "body"
    assert refused.value.message.startswith("Invalid 'body': ")


def test_a_body_nested_past_the_serialiser_is_refused_by_name() -> None:
    content: Any = "x"
    for _ in range(300):
        content = [content]
    body = {"model": "fake", "messages": [{"role": "user", "content": content}]}
    with pytest.raises(InvalidRequest) as refused:
        check_request("/v1/chat/completions", body)
    assert refused.value.message == "request body is nested too deeply"


# ---- validation: n ------------------------------------------------------------------------


_CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_is_bounded_at_max_n(path: str) -> None:
    body: dict[str, Any] = dict(_CHAT) if "chat" in path else {"model": "fake", "prompt": "hi"}
    assert MAX_N == 128
    check_request(path, {**body, "n": 1})
    check_request(path, {**body, "n": MAX_N})  # the bound itself is allowed
    for too_many in (MAX_N + 1, 10**6):
        with pytest.raises(InvalidRequest) as refused:
            check_request(path, {**body, "n": too_many})
        assert refused.value.param == "n"
        assert "128" in str(refused.value)


# ---- the reused tokens a streamed decode-local turn claims -----------------------------------


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


def _post(url: str, conversation: str, messages: list[Any], stream: bool) -> httpx.Response:
    body = {"model": "fake", "messages": messages, "stream": stream}
    response = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
    )
    assert response.status_code == 200, response.text
    return response


#: A request whose prompt is some hundreds of tokens (the fake engine counts a token a byte).
_HISTORY = {"role": "user", "content": "List the root directory, then say what each entry is. " * 5}


@pytest.mark.parametrize("block_size", [0, 128])
@pytest.mark.parametrize("case", ["counted", "prefix", "bounded"])
def test_a_streamed_local_turn_claims_exactly_the_whole_blocks_it_can_reuse(
    fake_url: str, monkeypatch: pytest.MonkeyPatch, block_size: int, case: str
) -> None:
    """A streamed decode-local turn's ``X-Kvturn-Reused-Tokens`` is the gateway's own word
    (no usage from the engine has arrived when the headers go): the verified prefix the holder
    retains (counted: never the prompt's last token, which the engine always computes),
    in whole blocks of the holder when its block size is known. One token more is a claim the
    holder's prefix cache cannot serve.

    ``counted``: the prompt (the same request again) is longer than the verified prefix
    (whole digest chunks, short of the held prompt's last tokens); ``prefix``: the new prompt
    is the verified prefix itself (a completion request of exactly those token ids), so its
    last token, which the engine always computes, bounds the claim; ``bounded``: the turn
    extends the held one and is planned from a bound on its new tokens."""
    from tests import fake_engine

    if block_size:  # the fake reports its engine facts (its block size) with a lease limit
        monkeypatch.setattr(fake_engine, "MAX_LEASE_S", 300.0)
        monkeypatch.setattr(fake_engine, "BLOCK_SIZE", block_size)
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        holder = gateway.app.state.gateway.decode.instances[0]
        if block_size:
            _until(lambda: holder.block_size == block_size, "the block size was never learned")
        conversation = f"claims-{block_size}-{case}"
        messages = [_HISTORY]
        _post(gateway.url, conversation, messages, stream=False)
        _recorded(gateway, conversation)
        entry = gateway.app.state.gateway.store.peek(scoped_key("", conversation))
        held_digest_tokens = entry.held_digest_tokens
        prompt = fake_engine.prompt_ids({"messages": messages})
        # The held prompt's whole digest chunks, short of its last 8 tokens (BOUNDARY_TOKENS).
        assert held_digest_tokens == (len(prompt) - 8) // 16 * 16 > 128
        path, body = "/v1/chat/completions", {"model": "fake", "messages": messages}
        if case == "bounded":  # planned from a bound on its new tokens: never counted
            body["messages"] = [*messages, _REPLY, _TOOL_RESULT]
            verified = held_digest_tokens
        else:  # counted by the engine's tokenizer
            if case == "prefix":  # the digested tokens, no more
                path = "/v1/completions"
                body = {"model": "fake", "prompt": prompt[:held_digest_tokens]}
            counted = httpx.post(fake_url + "/tokenize", json=body)
            verified = min(held_digest_tokens, counted.json()["count"] - 1)
        assert verified == held_digest_tokens - (1 if case == "prefix" else 0)
        expected = verified - verified % block_size if block_size else verified
        second = httpx.post(
            gateway.url + path, json={**body, "stream": True},
            headers={"X-Conversation-Id": conversation},
        )  # fmt: skip
        assert second.status_code == 200, second.text
        assert second.headers["x-kvturn-plan"] == "decode-local"
        assert holder.block_size == block_size
        assert int(second.headers["x-kvturn-reused-tokens"]) == expected


# ---- main's shared-KV plan (choose_shared) and the table's snapshot -------------------------


class _Recording(CostModel):
    def __init__(self, local: float, recompute: float) -> None:
        super().__init__()
        self.local_s, self.recompute_s = local, recompute
        self.calls: list[tuple[Any, ...]] = []

    def local_seconds(self, decode_url: str, suffix: int, prefill_url: str | None = None) -> float:
        self.calls.append(("local", decode_url, suffix, prefill_url))
        return self.local_s

    def recompute_seconds(self, prefill_url: str, prompt: int) -> float:
        self.calls.append(("recompute", prefill_url, prompt))
        return self.recompute_s


def _shared(**change: Any) -> SharedInputs:
    values: dict[str, Any] = dict(
        kind="fork", prompt_tokens=1100, covered_tokens=1000, holder_running=0,
        holder_url="http://d", prefill_url="http://p",
    )  # fmt: skip
    values.update(change)
    return SharedInputs(**values)


def test_shared_kv_of_exactly_the_threshold_is_used_and_costed_on_its_engines() -> None:
    costs = _Recording(local=0.0, recompute=1.0)
    plan = choose_shared(_shared(), LocalLimits(), costs, threshold_tokens=1000)
    assert plan == TurnPlan("decode-local", "fork")
    assert costs.calls == [("local", "http://d", 100, "http://p"), ("recompute", "http://p", 1100)]
    assert choose_shared(_shared(covered_tokens=999), LocalLimits(), costs, 1000) is None


def test_shared_kv_suffix_and_preference_bounds() -> None:
    one = LocalLimits(max_suffix_tokens=1)
    cheap = _Recording(local=0.0, recompute=1.0)
    for prompt in (1000, 1001):
        assert choose_shared(_shared(prompt_tokens=prompt), one, cheap, 64) is not None, prompt
    assert choose_shared(_shared(prompt_tokens=1002), one, cheap, 64) is None
    half = LocalLimits(preference=0.5)
    assert choose_shared(_shared(), half, _Recording(local=3.0, recompute=2.0), 64) is not None
    assert choose_shared(_shared(), half, _Recording(local=3.5, recompute=2.0), 64) is None
    # One stream on the holder doubles the local cost: 4.0 against 2.5 * 1.25 (the stall
    # budget aside: it has tests of its own).
    busy = _shared(holder_running=1)
    unbudgeted = LocalLimits(stall_budget_s=math.inf)
    assert choose_shared(busy, unbudgeted, _Recording(local=2.0, recompute=2.5), 64) is None
    assert choose_shared(busy, unbudgeted, _Recording(local=1.0, recompute=2.5), 64)
    assert choose_shared(_shared(), LocalLimits(), _Recording(local=2.0, recompute=2.5), 64)


def test_recompute_costs_prefill_of_the_prompt_and_the_handoff() -> None:
    costs = CostModel()
    _fast_prefill(costs)
    prefill = costs.prefill["http://p"].predict(1000)
    assert costs.recompute_seconds("http://p", 1000) == pytest.approx(prefill + 0.020 + 1e-3)


async def test_a_snapshot_shares_no_event_with_the_entry() -> None:
    store = ConversationStore(10)
    taken = await store.take("c", "c", None)
    store.settling("c", taken.turn)
    copy = await store.snapshot("c")
    assert copy is not None and copy.settling is None
    assert store.peek("c").settling is not None  # type: ignore[union-attr]
