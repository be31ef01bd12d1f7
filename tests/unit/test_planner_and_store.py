import pickle
import sys

from kvturn.gateway.conversations import ConversationStore
from kvturn.gateway.planner import plan_turn


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
    store.record_retained(conversation, "http://d", "r1", 5000, kv_expires_in_s=100, lease_s=30)
    assert _plan(store, "c") == "reuse"
    assert _plan(store, "c", healthy=False) == "holder-unhealthy"
    clock.now += 31
    assert _plan(store, "c") == "lease-expired"


def test_lease_renewal_never_outlives_the_kv() -> None:
    clock = FakeClock()
    store = ConversationStore(10, clock=clock)
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 5000, kv_expires_in_s=40, lease_s=30)
    clock.now += 20
    assert store.renew(conversation, lease_s=30) == 20  # capped by the KV's 40 s
    clock.now += 16
    # Inside the expiry margin the KV is not reused even though the lease is alive.
    assert _plan(store, "c") == "lease-expired"


def test_small_holdings_recompute() -> None:
    store = ConversationStore(10, clock=FakeClock())
    conversation = store.get_or_create("c")
    store.record_retained(conversation, "http://d", "r1", 63, kv_expires_in_s=100, lease_s=30)
    assert _plan(store, "c") == "below-threshold"


def test_store_is_lru_bounded_and_entries_stay_small() -> None:
    store = ConversationStore(3, clock=FakeClock())
    for i in range(5):
        store.get_or_create(f"conv-{i}")
    assert len(store) == 3 and store.get("conv-0") is None
    conversation = store.get_or_create("x" * 128)
    store.record_retained(
        conversation, "http://127.0.0.1:18101", "kvturn-" + "f" * 32, 16000,
        kv_expires_in_s=480, lease_s=60,
    )  # fmt: skip
    # Metadata only: a long-history conversation is still a few hundred bytes.
    size = sys.getsizeof(conversation) + sum(
        sys.getsizeof(getattr(conversation, f)) for f in conversation.__slots__
    )
    assert size < 1024, size
    assert len(pickle.dumps(conversation)) < 1024
