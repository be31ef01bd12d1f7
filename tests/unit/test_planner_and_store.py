import pickle
import sys

from kvturn.gateway.planner import plan_turn
from kvturn.gateway.state.table_in_process import ConversationStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plan(store: ConversationStore, cid: str, healthy: bool = True) -> str:
    return plan_turn(
        store.get(cid), store.clock(), holder_healthy=healthy, expiry_margin_s=5,
        threshold_tokens=64,
    ).reason  # fmt: skip


def test_plan_follows_the_conversation_lifecycle() -> None:
    clock = FakeClock()
    store = ConversationStore(10, clock=clock)
    assert (
        plan_turn(None, 0, holder_healthy=True, expiry_margin_s=5, threshold_tokens=64).plan
        == "recompute"
    )
    conversation = store.get_or_create("c")
    assert _plan(store, "c") == "first-turn"
    store.record_retained(conversation, "http://d", "r1", 5000, lease_expires_in_s=30)
    assert _plan(store, "c") == "reuse"
    assert _plan(store, "c", healthy=False) == "holder-unhealthy"
    clock.now += 31
    assert _plan(store, "c") == "lease-expired"


def test_the_table_follows_the_holders_answers() -> None:
    clock = FakeClock()
    store = ConversationStore(10, clock=clock)
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 5000, lease_expires_in_s=30)
    clock.now += 20
    # The holder renewed its lease by 30 s: the table takes its word.
    assert store.renew(conversation, 30.0) == 30.0
    clock.now += 26
    # Inside the expiry margin the KV is not reused even though the lease is alive.
    assert _plan(store, "c") == "lease-expired"
    # A holder that has no lease any more (expired, reclaimed): the KV is forgotten.
    assert store.renew(conversation, None) == 0.0
    assert conversation.holder_url is None and _plan(store, "c") == "first-turn"


def test_small_holdings_recompute() -> None:
    store = ConversationStore(10, clock=FakeClock())
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 63, lease_expires_in_s=30)
    assert _plan(store, "c") == "below-threshold"


def test_store_is_lru_bounded_and_entries_stay_small() -> None:
    store = ConversationStore(3, clock=FakeClock())
    for i in range(5):
        store.get_or_create(f"conv-{i}")
    assert len(store) == 3 and store.get("conv-0") is None
    conversation = store.get_or_create("tenant-a/" + "x" * 128, "x" * 128)
    store.record_retained(
        conversation, "http://127.0.0.1:18101", "kvturn-" + "f" * 32, 16000,
        lease_expires_in_s=60, held_digest="ab" * 12, held_digest_tokens=16000,
        held_salt=b"\x01" * 8,
    )  # fmt: skip
    # Metadata only: a long-history conversation with a 128-character id under a tenant is
    # about a kilobyte, all of it fields (the KV's block list stays on decode).
    size = sys.getsizeof(conversation) + sum(
        sys.getsizeof(getattr(conversation, f)) for f in conversation.__slots__
    )
    assert size < 1280, size
    assert len(pickle.dumps(conversation)) < 1024


def test_sweeps_forget_idle_conversations_in_bounded_batches() -> None:
    clock = FakeClock()
    store = ConversationStore(100, clock=clock)
    for i in range(10):
        store.get_or_create(f"idle-{i}")
    held = store.get_or_create("held")
    store.record_retained(held, "http://d", "r1", 5000, lease_expires_in_s=500)
    for i in range(3):
        store.get_or_create(f"late-{i}")
    clock.now += 100
    assert store.sweep(idle_s=60, budget=4) == 4  # bounded: four per sweep
    assert store.sweep(idle_s=60, budget=100) == 6  # then stops at the one with live KV
    assert store.peek("held") is held and len(store) == 4
    clock.now += 500  # its lease lapsed and it stayed idle: it goes, and what came after
    assert store.sweep(idle_s=60, budget=100) == 4 and len(store) == 0
    # A turn or heartbeat touches an entry: it is used now, and not swept.
    touched = store.get_or_create("touched")
    clock.now += 100
    assert store.get("touched") is touched
    assert store.sweep(idle_s=60, budget=100) == 0
