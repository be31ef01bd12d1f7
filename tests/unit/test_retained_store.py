import threading
import time

import httpx

from kvturn.connector.control_server import ControlServer
from kvturn.connector.retained_store import RetainedStore, publication_key


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_publication_key_strips_vllm_decorations() -> None:
    assert publication_key("chatcmpl-kvturn-abc-1234abcd") == "kvturn-abc"
    # vLLM 0.32 names a completion "cmpl-<X-Request-Id>-<prompt position>-<8 hex>".
    assert publication_key("cmpl-req-9-0-deadbeef") == "req-9"
    assert publication_key("cmpl-kvturn-ab12-7-0-0123abcd") == "kvturn-ab12-7"
    assert publication_key("plain") == "plain"


def test_a_request_id_that_looks_decorated_is_found_as_sent() -> None:
    store = RetainedStore()
    # The gateway's ids end in a counter: "-12345678" looks like vLLM's random suffix.
    store.publish("chatcmpl-kvturn-ab-12345678-0f0f0f0f", {"remote_num_tokens": 5}, ttl_s=10)
    assert store.get("kvturn-ab-12345678") is not None
    assert store.discard("chatcmpl-kvturn-ab-12345678-0f0f0f0f")


def test_entries_expire_and_report_time_left() -> None:
    clock = FakeClock()
    store = RetainedStore(clock=clock)
    store.publish("chatcmpl-r1-0000abcd", {"remote_num_tokens": 5}, ttl_s=10)
    clock.now += 4
    got = store.get("r1")
    assert got == {"remote_num_tokens": 5, "expires_in_s": 6.0}
    clock.now += 6
    assert store.get("r1") is None
    assert len(store) == 0


def test_store_is_bounded() -> None:
    store = RetainedStore(max_entries=3)
    for i in range(5):
        store.publish(f"r{i}", {"i": i}, ttl_s=60)
    assert len(store) == 3
    assert store.get("r0") is None and store.get("r4") is not None


def test_get_waits_for_a_late_publication() -> None:
    store = RetainedStore()
    threading.Timer(0.05, store.publish, args=("late", {"ok": True}, 60)).start()
    started = time.monotonic()
    assert store.get("late", wait_s=2.0) is not None
    assert time.monotonic() - started < 1.0
    assert store.get("never", wait_s=0.05) is None


def test_control_server_serves_the_store() -> None:
    store = RetainedStore()
    server = ControlServer(store, "127.0.0.1", 0).start()
    try:
        base = f"http://127.0.0.1:{server.port}/kvturn"
        store.publish("chatcmpl-x-11112222", {"remote_num_tokens": 7}, ttl_s=30)
        assert httpx.get(f"{base}/retained/x").json()["remote_num_tokens"] == 7
        assert httpx.get(f"{base}/retained/y").status_code == 404
        assert httpx.get(f"{base}/retained/x?wait_ms=oops").status_code == 400
        assert httpx.get(f"{base}/health").json() == {"ok": True, "retained": 1}
    finally:
        server.stop()
