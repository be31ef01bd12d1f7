"""The conversation table's contract, for both implementations: in process and a real Redis.

What must hold across gateway replicas: a turn takes the KV off the table for itself alone;
a record is kept only if no newer turn recorded first and the entry is the one the turn
started in; the record replacing older KV says so (someone must free it); a Redis outage
is an error the turn path can recompute on, never a hang or a wrong answer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from kvturn.gateway.errors import StateUnavailable
from kvturn.gateway.state.implicit import Indexed, RedisImplicitIndex
from kvturn.gateway.state.redis_client import RedisState
from kvturn.gateway.state.response_store import MemoryResponseStore, RedisResponseStore
from kvturn.gateway.state.stores import open_state
from kvturn.gateway.state.table import ConversationTable, Held, fresh_turn
from kvturn.gateway.state.table_in_process import ConversationStore
from kvturn.gateway.state.table_redis import RedisConversations
from tests.gateway_fixtures import RedisServer, free_port, running_redis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture(params=["memory", "redis"], loop_scope="function")
async def table(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ConversationTable, Clock]]:
    clock = Clock()
    made: Any
    redis = None
    if request.param == "memory":
        made = ConversationStore(100, clock=clock)
    else:
        redis = _redis(request.getfixturevalue("redis_server").url)
        made = RedisConversations(redis, idle_s=600, clock=clock)
    try:
        yield made, clock
    finally:
        if redis is not None:
            await redis.close()


def _redis(url: str, on_error: Any = None) -> RedisState:
    """The state's one client, on keys of this test's own."""
    return RedisState(url, timeout_s=0.5, prefix=f"t{uuid.uuid4().hex}:", on_error=on_error)


async def _settling(store: ConversationTable, key: str, turn: int) -> None:
    marking = store.settling(key, turn)
    if marking is not None:
        await marking


def _held(request_id: str, tokens: int = 4000, lease_s: float = 30.0) -> Held:
    return Held(
        "http://decode-1",
        request_id,
        held_tokens=tokens,
        lease_expires_in_s=lease_s,
        held_digest="ab" * 12,
        held_digest_tokens=256,
        held_salt=b"\x01" * 8,
        held_prompt_mark="3:" + "cd" * 16 + ":" + "ef" * 8,
    )


async def test_a_turn_takes_the_kv_for_itself_alone(table: tuple[ConversationTable, Clock]) -> None:
    store, clock = table
    first = await store.take("k", "conv", "turn-1")
    assert (first.turn, first.retry, first.conversation.holder_url) == (1, False, None)
    assert first.conversation.conversation_id == "conv"
    recorded = await store.record("k", first.conversation.epoch, first.turn, _held("r1"))
    assert recorded.kept and recorded.replaced is None

    second = await store.take("k", "conv", "turn-2")
    held = second.conversation
    assert second.turn == 2
    assert (held.holder_url, held.holder_request_id, held.held_tokens) == (
        "http://decode-1", "r1", 4000
    )  # fmt: skip
    assert (held.held_digest, held.held_digest_tokens, held.held_salt) == (
        "ab" * 12, 256, b"\x01" * 8
    )  # fmt: skip
    assert held.held_prompt_mark == "3:" + "cd" * 16 + ":" + "ef" * 8
    assert held.lease_expires_at == pytest.approx(clock.now + 30)
    # A parallel turn (another replica) finds nothing to pull: decode frees after one read.
    parallel = await store.take("k", "conv", "turn-3")
    assert parallel.turn == 3 and parallel.conversation.holder_url is None
    assert parallel.conversation.held_prompt_mark is None


async def test_a_take_says_when_the_conversation_was_last_seen_before_it(
    table: tuple[ConversationTable, Clock],
) -> None:
    """The gap a client paused for, from its last turn's record to its next turn's take
    (what the gateway learns a tenant's lease length from: gateway/returns.py)."""
    store, clock = table
    first = await store.take("k", "conv", "turn-1")
    assert first.conversation.last_seen == 0.0  # a new entry: no gap to learn from
    clock.now += 0.5
    await store.record("k", first.conversation.epoch, first.turn, _held("r1"))
    recorded_at = clock.now
    clock.now += 7.25
    second = await store.take("k", "conv", "turn-2")
    assert clock.now - second.conversation.last_seen == pytest.approx(7.25)
    clock.now += 1.0
    # This take is seen too: the next one's gap starts from it.
    third = await store.take("k", "conv", "turn-3")
    assert third.conversation.last_seen == pytest.approx(recorded_at + 7.25)


async def test_parallel_takes_never_share_the_kv(table: tuple[ConversationTable, Clock]) -> None:
    store, _ = table
    first = await store.take("k", "conv", None)
    await store.record("k", first.conversation.epoch, first.turn, _held("r1"))
    takes = await asyncio.gather(*(store.take("k", "conv", None) for _ in range(20)))
    holders = [t for t in takes if t.conversation.holder_request_id == "r1"]
    assert len(holders) == 1
    assert sorted(t.turn for t in takes) == list(range(2, 22))


async def test_a_record_older_than_a_recorded_turn_is_refused(
    table: tuple[ConversationTable, Clock],
) -> None:
    store, _ = table
    first = await store.take("k", "conv", None)
    older = await store.take("k", "conv", None)
    newer = await store.take("k", "conv", None)
    epoch = first.conversation.epoch
    assert (await store.record("k", epoch, newer.turn, _held("new"))).kept
    # The older turn ended last: its KV must not replace the newer one's (the caller frees it).
    refused = await store.record("k", epoch, older.turn, _held("old"))
    assert not refused.kept and refused.replaced is None
    assert (await store.take("k", "conv", None)).conversation.holder_request_id == "new"


async def test_a_record_replacing_unread_kv_names_it(
    table: tuple[ConversationTable, Clock],
) -> None:
    store, _ = table
    a = await store.take("k", "conv", None)
    b = await store.take("k", "conv", None)  # began before a recorded: took nothing
    epoch = a.conversation.epoch
    assert (await store.record("k", epoch, a.turn, _held("ra"))).replaced is None
    replaced = await store.record("k", epoch, b.turn, _held("rb"))
    assert replaced.kept and replaced.replaced == ("http://decode-1", "ra")


async def test_a_turn_begun_before_a_release_records_nothing_after_it(
    table: tuple[ConversationTable, Clock],
) -> None:
    store, _ = table
    before = await store.take("k", "conv", None)
    removed = await store.remove("k")
    assert removed is not None and removed.conversation_id == "conv"
    again = await store.take("k", "conv", None)  # the same id, a new conversation
    assert again.conversation.epoch != before.conversation.epoch
    late = await store.record("k", before.conversation.epoch, before.turn, _held("late"))
    assert not late.kept
    assert (await store.lookup("k")) is not None
    assert (await store.lookup("k")).holder_url is None  # type: ignore[union-attr]
    assert await store.remove("missing") is None
    # Nothing held: nothing for the caller to free, whatever became of the entry.
    assert (await store.record("missing", 7, 1, None)).kept


async def test_retries_heartbeats_and_renewals(table: tuple[ConversationTable, Clock]) -> None:
    store, clock = table
    first = await store.take("k", "conv", "t1")
    assert (await store.take("k", "conv", "t1")).retry  # the SDK resent the same turn
    assert not (await store.take("k", "conv", "t2")).retry
    assert not (await store.take("k", "conv", None)).retry
    third = await store.take("k", "conv", None)
    await store.record("k", first.conversation.epoch, third.turn, _held("r5", lease_s=10))
    clock.now += 8
    seen = await store.lookup("k")
    assert seen is not None and seen.holder_request_id == "r5" and seen.retries == 1
    assert seen.heartbeats == 1
    assert await store.renewed("k", "r5", 30.0) == 30.0
    assert (await store.lookup("k")).lease_expires_at == pytest.approx(clock.now + 30)  # type: ignore[union-attr]
    # A renewal for a lease a turn has taken meanwhile changes nothing.
    assert await store.renewed("k", "other", 99.0) == 0.0
    # The holder has no lease any more: the KV is forgotten.
    assert await store.renewed("k", "r5", None) == 0.0
    assert (await store.lookup("k")).holder_url is None  # type: ignore[union-attr]


async def test_counts_of_entries_and_live_leases(table: tuple[ConversationTable, Clock]) -> None:
    store, clock = table
    for i in range(3):
        taken = await store.take(f"k{i}", f"c{i}", None)
        if i:
            await store.record(
                f"k{i}", taken.conversation.epoch, taken.turn, _held(f"r{i}", lease_s=10 * i)
            )
    assert await store.counts() == (3, 2)
    clock.now += 15
    assert await store.counts() == (3, 1)  # k1's lease lapsed
    await store.remove("k2")
    assert await store.counts() == (2, 0)


async def test_a_next_turn_waits_for_a_reply_under_way_and_no_longer(
    table: tuple[ConversationTable, Clock],
) -> None:
    store, clock = table
    first = await store.take("k", "conv", None)
    await _settling(store, "k", first.turn)
    # A long reply: marked as it started, 30 s before it ended and the next turn came.
    clock.now += 30
    loop = asyncio.get_running_loop()

    async def record_soon() -> None:
        await asyncio.sleep(0.1)
        await store.record("k", first.conversation.epoch, first.turn, _held("r1"))

    recording = asyncio.create_task(record_soon())
    started = loop.time()
    taken = await store.take("k", "conv", None, wait_s=5.0)
    waited = loop.time() - started
    await recording
    assert 0.05 <= waited < 4.0, waited  # until the record, not the timeout
    assert taken.conversation.holder_request_id == "r1" and taken.turn == 2
    # A reply whose record never comes (its gateway died) holds the next turn up to the
    # wait only.
    await _settling(store, "k", taken.turn)
    started = loop.time()
    late = await store.take("k", "conv", None, wait_s=0.2)
    assert 0.15 <= loop.time() - started < 4.0 and late.turn == 3
    started = loop.time()
    await store.take("unknown", "conv", None, wait_s=5.0)  # nothing under way: no wait
    assert loop.time() - started < 1.0


async def test_a_new_conversations_first_write_makes_its_entry(
    table: tuple[ConversationTable, Clock],
) -> None:
    """A turn of a conversation whose key was just drawn takes nothing (no call): its record
    makes the entry, and indexes it by its messages in the same step; or, for a reply under
    way, its mark makes and indexes it, and next turns wait for the record as for any
    other."""
    store, _ = table
    first = fresh_turn("k", "conv")
    assert first.fresh and first.turn == 1 and await store.lookup("k") is None
    digest = b"\x01" * 16
    recorded = await store.record(
        "k",
        first.conversation.epoch,
        first.turn,
        _held("r1"),
        fresh=first.conversation,
        findable=(digest, Indexed("k", "conv")),
    )
    assert recorded.kept and recorded.replaced is None
    assert await store.implicit.match([b"\x02" * 16, digest]) == Indexed("k", "conv")
    second = await store.take("k", "conv", None)
    assert second.turn == 2 and second.conversation.holder_request_id == "r1"
    assert second.conversation.conversation_id == "conv"
    # The mark of a streamed first turn makes the entry; its record (no ``fresh``: the mark
    # made it) is kept, and a next turn that came meanwhile waited for it.
    streamed = fresh_turn("s", "streamed")
    marked = (b"\x04" * 16, Indexed("s", "streamed"))
    marking = store.settling("s", streamed.turn, streamed.conversation, marked)
    if marking is not None:
        await marking
    assert await store.implicit.match([marked[0]]) == Indexed("s", "streamed")

    async def record_soon() -> None:
        await asyncio.sleep(0.1)
        await store.record("s", streamed.conversation.epoch, streamed.turn, _held("rs"))

    recording = asyncio.create_task(record_soon())
    taken = await store.take("s", "streamed", None, wait_s=5.0)
    await recording
    assert taken.turn == 2 and taken.conversation.holder_request_id == "rs"
    # A fresh record finds an entry made since under another epoch (released and made anew):
    # not kept, and nothing else changed.
    again = fresh_turn("k", "conv")
    refused = await store.record(
        "k", again.conversation.epoch, again.turn, _held("stale"), fresh=again.conversation
    )
    assert not refused.kept
    assert (await store.lookup("k")).turns == 2  # type: ignore[union-attr]
    # Nothing to index where there is no entry (the conversation was released).
    await store.remove("k")
    await store.record("k", 7, 3, None, findable=(b"\x03" * 16, Indexed("k", "conv")))
    assert await store.implicit.match([b"\x03" * 16]) is None
    assert await store.counts() == (1, 0)  # "s", made by its mark (its KV taken by turn 2)


async def test_redis_outage_raises_state_unavailable_quickly() -> None:
    failed: list[str] = []
    redis = _redis(f"redis://127.0.0.1:{free_port()}/0", on_error=failed.append)
    store = RedisConversations(redis, idle_s=60)
    try:
        for call in (
            store.take("k", "c", None),
            store.record("k", 7, 1, _held("r")),
            store.lookup("k"),
            store.renewed("k", "r", 1.0),
            store.remove("k"),
            store.counts(),
            store.take("k", "c", None, wait_s=1.0),
            _settling(store, "k", 1),
            store.implicit.match([b"\x01" * 16]),
        ):
            with pytest.raises(StateUnavailable):
                await asyncio.wait_for(call, 5)
        assert failed == [
            "take", "record", "lookup", "renewed", "remove", "counts", "take", "settling",
            "implicit_match",
        ]  # fmt: skip
        assert not store.reachable
    finally:
        await redis.close()


async def test_redis_entries_expire_by_themselves(redis_server: RedisServer) -> None:
    redis = _redis(redis_server.url)
    store = RedisConversations(redis, idle_s=0.3)
    try:
        taken = await store.take("k", "conv", None)
        await store.record("k", taken.conversation.epoch, taken.turn, _held("r1", lease_s=0.1))
        assert await store.lookup("k") is not None
        await asyncio.sleep(0.6)
        assert await store.lookup("k") is None
        assert await store.counts() == (0, 0)
    finally:
        await redis.close()


async def test_a_gateways_stores_share_one_redis_client_and_timeout(
    redis_server: RedisServer,
) -> None:
    failed: list[str] = []
    state = open_state(
        redis_server.url,
        max_conversations=10,
        idle_s=60,
        max_responses=10,
        responses_ttl_s=60,
        timeout_s=0.25,
        on_error=failed.append,
    )
    try:
        assert state.redis is not None
        client = state.redis.client
        pool = client.connection_pool.connection_kwargs
        assert (pool["socket_timeout"], pool["socket_connect_timeout"]) == (0.25, 0.25)
        table, responses = state.table, state.responses
        assert isinstance(table, RedisConversations)
        assert isinstance(table.implicit, RedisImplicitIndex)
        assert isinstance(responses, RedisResponseStore)
        assert table._client is table.implicit._redis.client is responses._redis is client
        assert table.reachable and await table.counts() == (0, 0)
    finally:
        await state.close()
    in_process = open_state(
        "memory", max_conversations=10, idle_s=60, max_responses=10, responses_ttl_s=60,
        timeout_s=0.25,
    )  # fmt: skip
    assert isinstance(in_process.table, ConversationStore) and in_process.redis is None
    assert isinstance(in_process.responses, MemoryResponseStore)
    await in_process.close()
    with pytest.raises(ValueError, match="unknown state store"):
        open_state(
            "postgres://x", max_conversations=10, idle_s=60, max_responses=10,
            responses_ttl_s=60, timeout_s=0.25,
        )  # fmt: skip


async def test_a_snapshot_reads_an_entry_and_changes_nothing(
    table: tuple[ConversationTable, Clock],
) -> None:
    """What a fork reads of its parent: where the KV lives, and how far the parent got; not a
    turn, not a heartbeat, and the KV stays for the parent's next turn."""
    store, _ = table
    assert await store.snapshot("parent") is None
    taken = await store.take("parent", "p", "t1")
    indexed = (b"\x05" * 16, Indexed("parent", "p", 1, "http://decode-1", "ab" * 12, 256))
    await store.record("parent", taken.conversation.epoch, 1, _held("r1"), findable=indexed)
    for _ in range(2):
        seen = await store.snapshot("parent")
        assert seen is not None and seen.holder_request_id == "r1" and seen.recorded_turn == 1
        assert (seen.turns, seen.heartbeats, seen.held_digest_tokens) == (1, 0, 256)
    assert await store.implicit.match([indexed[0]]) == indexed[1]
    again = await store.take("parent", "p", "t2")
    assert again.turn == 2 and again.conversation.holder_request_id == "r1"


async def test_a_take_after_an_older_turn_takes_nothing(
    table: tuple[ConversationTable, Clock],
) -> None:
    """A request without an id that extends turn 1 of a conversation that recorded turn 2 is
    a fork: nothing is taken or counted, and it learns where the KV is now."""
    store, _ = table
    first = await store.take("c", "conv", "t1")
    await store.record("c", first.conversation.epoch, 1, _held("r1"))
    second = await store.take("c", "conv", "t2", after_turn=1)
    assert not second.moved_on and second.turn == 2
    await store.record("c", second.conversation.epoch, 2, _held("r2"))
    fork = await store.take("c", "conv", "t3", after_turn=1)
    assert fork.moved_on and fork.conversation.holder_request_id == "r2"
    # Nothing begun: no turn number, no retry, and (in process) not the entry's own event.
    assert fork.turn == 0 and fork.retry is False and fork.conversation.settling is None
    assert fork.conversation.recorded_turn == 2
    entry = await store.snapshot("c")
    assert entry is not None and (entry.turns, entry.holder_request_id) == (2, "r2")
    assert entry.last_turn_id == "t2"
    # The parent's own next turn extends turn 2: it takes the KV.
    third = await store.take("c", "conv", "t3", after_turn=2)
    assert not third.moved_on and third.turn == 3
    assert third.conversation.holder_request_id == "r2"


async def test_the_live_count_is_the_entries_whose_lease_has_not_lapsed() -> None:
    """Kept as leases come and go (no scan of the table per scrape): after any mix of records,
    renewals, takes, releases, evictions and lapses, it equals a count of the table."""
    import random

    clock = Clock()
    store = ConversationStore(max_conversations=50, clock=clock)
    rng = random.Random(7)
    for step in range(3000):
        key = f"k{rng.randrange(80)}"
        action = rng.randrange(6)
        if action == 0:
            taken = await store.take(key, key, None)
            await store.record(key, taken.conversation.epoch, taken.turn, _held(f"r{step}",
                               lease_s=rng.uniform(0.5, 20)))  # fmt: skip
        elif action == 1 and store.peek(key) is not None:
            await store.renewed(key, store.peek(key).holder_request_id or "", rng.choice(
                [None, rng.uniform(0.5, 20)]))  # fmt: skip
        elif action == 2:
            await store.remove(key)
        elif action == 3:
            clock.now += rng.uniform(0, 2)
        elif action == 4:
            store.sweep(idle_s=5, budget=3)
        entries, live = await store.counts()
        brute = sum(1 for c in store._items.values() if c.lease_expires_at > clock.now)
        assert (entries, live) == (len(store), brute), step


async def test_the_live_count_survives_renewals_and_evictions_of_live_leases() -> None:
    """A lease renewed again and again leaves its old expiries behind (the heap is rebuilt
    from the live ones past a bound); an entry evicted while its lease lives leaves the count."""
    clock = Clock()
    store = ConversationStore(max_conversations=3, clock=clock)
    taken = await store.take("k", "k", None)
    await store.record("k", taken.conversation.epoch, taken.turn, _held("r1", lease_s=30))
    for step in range(3000):
        assert await store.renewed("k", "r1", 30 + step / 1000) > 0
    assert await store.counts() == (1, 1)
    for key in ("a", "b", "c"):  # "k", the least recently used, is evicted, its lease live
        turn = await store.take(key, key, None)
        await store.record(key, turn.conversation.epoch, turn.turn, _held(f"r-{key}"))
    assert store.peek("k") is None and await store.counts() == (3, 3)
    clock.now += 60
    assert await store.counts() == (3, 0)
