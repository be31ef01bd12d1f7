"""Decode-side leases without vLLM: the table, its ordering, the block count, the control
channel (injected clocks, no sleeping on leases)."""

import threading
import time

import httpx
import pytest

from kvturn.connector.block_usage import BlockUsage, local_turn_blocks
from kvturn.connector.control_server import ControlServer
from kvturn.connector.leases import LeaseTable, PauseModel, publication_key
from kvturn.wire import EngineIdentity


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(clock: FakeClock, **kw: float) -> LeaseTable:
    return LeaseTable(clock, max_lease_s=kw.pop("max_lease_s", 120.0), guard_s=2.0, **kw)


def _retain(table: LeaseTable, n: int, conversation: str, lease_s: float = 20.0, blocks: int = 4):
    return table.retain(
        f"chatcmpl-r{n}-0000abcd", f"r{n}", conversation, {"remote_num_tokens": 64,
        "remote_blocks_expiry_time": 1.0}, [list(range(n * 10, n * 10 + blocks))], lease_s,
    )  # fmt: skip


def test_publication_key_strips_vllm_decorations() -> None:
    assert publication_key("chatcmpl-kvturn-abc-1234abcd") == "kvturn-abc"
    # vLLM 0.32 names a completion "cmpl-<X-Request-Id>-<prompt position>-<8 hex>".
    assert publication_key("cmpl-req-9-0-deadbeef") == "req-9"
    assert publication_key("cmpl-kvturn-ab12-7-0-0123abcd") == "kvturn-ab12-7"
    assert publication_key("plain") == "plain"


def test_a_lease_expires_unless_renewed_and_renewal_never_revives() -> None:
    clock = FakeClock()
    table = _table(clock)
    _retain(table, 1, "a")
    # NIXL frees the blocks 2 s (the guard) after the lease ends.
    assert table.take_deadlines() == {"chatcmpl-r1-0000abcd": 122.0}
    clock.now += 15
    renewed = table.renew("r1", 20.0, "tool", 15_000)
    assert renewed is not None and renewed.expires_at == 135.0 and renewed.pause_kind == "tool"
    assert table.take_deadlines() == {"chatcmpl-r1-0000abcd": 137.0}
    # A renewal never shortens a lease.
    assert table.renew("r1", 1.0) is not None and table.take_deadlines() == {}
    clock.now = 135.0
    assert table.get("r1") is None and table.renew("r1", 20.0) is None
    assert table.gone_reason("r1") == "expired"
    # The engine frees it at its deadline; the table records why.
    assert table.finished("chatcmpl-r1-0000abcd") == "expired"
    assert table.stats().ended == {"expired": 1} and len(table) == 0


def test_beats_keep_a_tool_pause_but_a_user_pause_only_as_long_as_users_return() -> None:
    """A client beats through any pause. A tool pause is a tool still running: each beat
    extends it. A user pause is extended no further than the length within which 95 % of
    users' pauses end (learned); past it, the beats no longer hold the KV."""
    clock = FakeClock()
    pauses = PauseModel()
    table = _table(clock, max_lease_s=600.0, pause_model=pauses)
    _retain(table, 1, "tool", lease_s=10.0)
    _retain(table, 2, "user", lease_s=10.0)
    longest = pauses.quantile("user", 0.95)
    assert 100 < longest < 400  # the prior: users read for a minute or so, some for minutes
    for _ in range(int(longest // 5) + 20):
        clock.now += 5
        assert table.renew("r1", 10.0, "tool") is not None
        table.renew("r2", 10.0, "user")
    # 100 s past the user's horizon: the tool lease lives on, the user's lapsed at it.
    assert table.get("r1") is not None and table.get("r1").expires_at == clock.now + 10  # type: ignore[union-attr]
    assert table.get("r2") is None and table.gone_reason("r2") == "expired"
    # Users of this deployment come back within seconds: the horizon follows them.
    for _ in range(200):
        pauses.observe("user", 4.0)
    assert pauses.quantile("user", 0.95) < 10
    _retain(table, 3, "quick", lease_s=10.0)
    clock.now += 5
    renewed = table.renew("r3", 10.0, "user")
    # Extended no further than the pause's start plus that horizon, but never shortened.
    assert renewed is not None and renewed.expires_at == clock.now + 5


def test_lease_is_capped_by_what_the_engine_honours() -> None:
    clock = FakeClock()
    table = _table(clock, max_lease_s=30.0)
    lease = _retain(table, 1, "a", lease_s=1e9)
    assert lease.expires_at == 130.0
    assert table.renew("r1", float("inf")) is not None
    assert table.get("r1").expires_at == 130.0  # type: ignore[union-attr]


def test_release_frees_now_and_a_newer_turn_supersedes() -> None:
    clock = FakeClock()
    table = _table(clock)
    _retain(table, 1, "a")
    _retain(table, 2, "a")  # the next turn of "a" on this decode
    deadlines = table.take_deadlines()
    assert deadlines["chatcmpl-r1-0000abcd"] < clock.now  # freed at once
    assert deadlines["chatcmpl-r2-0000abcd"] == 122.0
    assert table.finished("chatcmpl-r1-0000abcd") == "superseded"
    assert table.release("r2") and not table.release("r2")
    assert table.take_deadlines()["chatcmpl-r2-0000abcd"] < clock.now
    assert table.finished("chatcmpl-r2-0000abcd") == "released"
    assert table.gone_reason("r2") == "released" and table.gone_reason("r9") == "unknown"


def test_a_claimed_lease_outlives_expiry_release_and_pressure_until_read() -> None:
    clock = FakeClock()
    table = _table(clock, claim_s=30.0)
    _retain(table, 1, "a", lease_s=5.0)
    table.take_deadlines()
    clock.now += 4
    claimed = table.claim("r1")
    assert claimed is not None and claimed.expires_at == 134.0
    assert table.take_deadlines() == {"chatcmpl-r1-0000abcd": 136.0}
    assert table.claim("r1") is None  # read once
    # A release or memory pressure while a prefill reads waits for the read.
    assert table.release("r1")
    assert table.reclaim(100) == [] and table.take_deadlines() == {}
    assert table.finished("chatcmpl-r1-0000abcd") == "released"


def test_a_claim_that_ends_unread_is_freed_when_the_claimant_says_so_or_it_times_out() -> None:
    clock = FakeClock()
    table = _table(clock, claim_s=30.0)
    _retain(table, 1, "a")
    _retain(table, 2, "b")
    table.take_deadlines()
    table.claim("r1")
    table.claim("r2")
    assert table.release("r1", end_claim=True)
    assert table.take_deadlines()["chatcmpl-r1-0000abcd"] < clock.now
    assert table.release("r2")
    assert table.take_deadlines() == {}
    clock.now += 31
    assert table.take_deadlines()["chatcmpl-r2-0000abcd"] < clock.now


def test_a_claimed_lease_a_local_turn_superseded_is_freed_when_its_claim_ends() -> None:
    """A decode-local turn claims the previous lease (pressure takes it no more), and its own
    lease supersedes it when it ends: the blocks wait for the claim, which the gateway ends."""
    clock = FakeClock()
    table = _table(clock, claim_s=30.0)
    _retain(table, 1, "a")
    table.take_deadlines()
    assert table.claim("r1") is not None
    assert table.reclaim(100) == []
    _retain(table, 2, "a")  # the local turn's own: supersedes r1, which waits for its claim
    assert table.take_deadlines().get("chatcmpl-r1-0000abcd", clock.now + 1) > clock.now
    assert not table.release("r1", end_claim=True)  # already ending, but its claim is over
    assert table.take_deadlines()["chatcmpl-r1-0000abcd"] < clock.now
    assert table.finished("chatcmpl-r1-0000abcd") == "superseded"


def test_pressure_reclaims_user_pauses_first_then_the_least_likely_to_return() -> None:
    clock = FakeClock()
    table = _table(clock)
    _retain(table, 1, "tool-fresh")
    _retain(table, 2, "user-fresh")
    _retain(table, 3, "tool-long")
    _retain(table, 4, "unknown")
    for key, kind in (("r1", "tool"), ("r2", "user"), ("r3", "tool")):
        table.renew(key, 20.0, kind, 0)
    clock.now += 5
    # "tool-long" has been paused 10 minutes: tools come back in seconds, so it is unlikely to.
    table.renew("r3", 20.0, "tool", 600_000)
    assert table.reclaim_order() == ["r2", "r4", "r3", "r1"]
    taken = table.reclaim(6)  # 4 blocks each: two leases
    assert [lease.key for lease in taken] == ["r2", "r4"]
    assert table.ending_blocks() == 8
    deadlines = table.take_deadlines()
    assert {"chatcmpl-r2-0000abcd", "chatcmpl-r4-0000abcd"} <= set(deadlines)
    assert table.finished("chatcmpl-r2-0000abcd") == "reclaimed"
    assert table.gone_reason("r4") == "reclaimed"


def test_pause_model_learns_each_kind() -> None:
    model = PauseModel()
    before = model.return_probability("tool", 5.0, 5.0)
    for _ in range(200):
        model.observe("tool", 8.0)
    mu, sigma = model.params("tool")
    assert abs(mu - 2.0794) < 0.3 and sigma < 0.6
    # Learned: tools take ~8 s, so one paused 5 s is now likely back within 5 s.
    assert model.return_probability("tool", 5.0, 5.0) > before
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        model.observe("tool", bad)
    assert model.params("tool") == (mu, sigma)


def test_one_absurd_pause_cannot_skew_the_model() -> None:
    """The two-key probe's case: one tenant's pause of 1e308 ms. Before, the chance that a
    tool pause returns within 10 s fell from 0.878 to 0.002 (0.006 after 20 normal pauses),
    reordering every tenant's reclaims; each report now moves the model at most 3 sigma."""
    model = PauseModel()
    before = model.return_probability("tool", 0.0, 10.0)
    model.observe("tool", 1e308 / 1000)
    assert model.return_probability("tool", 0.0, 10.0) > 0.7 > 0.6 * before
    for _ in range(20):
        model.observe("tool", 2.0)
    assert model.return_probability("tool", 0.0, 10.0) > 0.85
    # A real shift still moves it, observation by observation.
    for _ in range(200):
        model.observe("tool", 600.0)
    assert model.return_probability("tool", 0.0, 10.0) < 0.1


def test_get_waits_for_a_late_retain_and_not_for_a_known_end() -> None:
    table = LeaseTable(time.monotonic, max_lease_s=60)
    threading.Timer(0.05, _retain, args=(table, 1, "a")).start()
    started = time.monotonic()
    assert table.get("r1", wait_s=5.0) is not None
    assert time.monotonic() - started < 2.5
    table.release("r1")
    table.finished("chatcmpl-r1-0000abcd")
    started = time.monotonic()
    assert table.get("r1", wait_s=5.0) is None
    assert time.monotonic() - started < 2.5


def test_block_usage_counts_shared_blocks_once() -> None:
    usage = BlockUsage(num_blocks=101)  # block 0 is vLLM's null block
    usage.set_blocks("req-a", [[1, 2, 3]])
    usage.set_blocks("req-b", [[1, 2, 4]])  # shares a cached prefix with req-a
    usage.add_blocks("req-a", [[5]])
    assert usage.used() == 5 and usage.free() == 95
    usage.set_blocks("lease:req-a", [[1, 2, 3, 5]])
    usage.drop("req-a")
    assert usage.used() == 5
    usage.drop_all(["req-b", "lease:req-a", "missing"])
    assert usage.used() == 0 and usage.free() == 100


def test_a_local_turn_whose_lease_lapsed_asks_for_its_cached_blocks_too() -> None:
    """While its conversation's lease lives, a decode-local turn's prefix hit is held by the
    lease and it asks only for the rest; once the lease lapsed, the hit blocks come from the
    free pool, so it asks for every block of its prompt (else pressure reclaims nothing and the
    turn waits for leases to lapse on their own)."""
    clock = FakeClock()
    table = _table(clock)
    _retain(table, 1, "a", lease_s=10.0)
    assert table.holds("a") and not table.holds("b")
    # 1,000 tokens, 896 of them (7 blocks of 128) a prefix-cache hit.
    asked = local_turn_blocks(1000, 896, 128, table.holds("a"))
    assert asked == 1
    clock.now += 10.0
    assert not table.holds("a")
    assert local_turn_blocks(1000, 896, 128, table.holds("a")) == 8
    _retain(table, 2, "a", lease_s=10.0)
    assert table.holds("a")
    assert table.release("r2") and not table.holds("a")
    assert local_turn_blocks(1000, 1000, 128, leased=True) == 0


@pytest.fixture
def control() -> tuple[LeaseTable, str]:
    table = LeaseTable(time.monotonic, max_lease_s=60)
    identity = EngineIdentity(
        engine_id="e-1", side_channel_host="10.0.0.3", side_channel_port=5600, transfer_mode="push"
    )
    server = ControlServer(table, "127.0.0.1", 0, secret="s3cret", identity=identity).start()
    yield table, f"http://127.0.0.1:{server.port}/kvturn"
    server.stop()


def test_control_channel_needs_the_secret(control: tuple[LeaseTable, str]) -> None:
    table, base = control
    _retain(table, 1, "a")
    before = table.get("r1").expires_at  # type: ignore[union-attr]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        assert httpx.post(f"{base}/leases/r1/renew", json={"lease_s": 50}, headers=headers
                          ).status_code == 401  # fmt: skip
        assert httpx.delete(f"{base}/leases/r1", headers=headers).status_code == 401
        assert httpx.post(f"{base}/leases/r1/claim", headers=headers).status_code == 401
        assert httpx.get(f"{base}/retained/r1", headers=headers).status_code == 401
        assert httpx.get(f"{base}/identity", headers=headers).status_code == 401
    lease = table.get("r1")
    assert lease is not None and lease.expires_at == before and lease.claimed_until == 0
    assert httpx.get(f"{base}/health").json() == {"ok": True, "draining": False}


def test_a_drain_is_asked_with_the_secret_shown_on_health_and_can_be_called_off(
    control: tuple[LeaseTable, str],
) -> None:
    _, base = control
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.post(f"{base}/drain").status_code == 401  # anyone else changes nothing
    assert httpx.get(f"{base}/health").json()["draining"] is False
    assert httpx.post(f"{base}/drain", headers=auth).json() == {"ok": True, "draining": True}
    assert httpx.get(f"{base}/health").json() == {"ok": True, "draining": True}
    assert httpx.delete(f"{base}/drain", headers=auth).json()["draining"] is False
    assert httpx.get(f"{base}/health").json()["draining"] is False


def test_the_control_server_reads_no_body_before_the_secret(
    control: tuple[LeaseTable, str],
) -> None:
    """Issue #39, case 7: a body was read before the secret was checked, and a refused body
    over 64 KB was parsed as the next request on the connection."""
    import socket

    _, base = control
    port = int(base.split(":")[2].split("/")[0])
    smuggled = b"GET /kvturn/health HTTP/1.1\r\nhost: x\r\n\r\n"
    for head in (
        # No secret: 401 from the head, the body never read.
        b"POST /kvturn/leases/r1/renew HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n",
        # The secret, but a body over the limit: 400, and the body is not a request.
        b"POST /kvturn/leases/r1/renew HTTP/1.1\r\nhost: x\r\nauthorization: Bearer s3cret"
        b"\r\ncontent-length: %d\r\n\r\n",
    ):
        body = smuggled * (70_000 // len(smuggled) + 1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(head % len(body) + body)
            answered = b""
            while chunk := conn.recv(65536):
                answered += chunk
        assert answered.count(b"HTTP/1.") == 1, answered[:300]
        assert answered.startswith((b"HTTP/1.0 401", b"HTTP/1.1 401", b"HTTP/1.0 400",
                                    b"HTTP/1.1 400"))  # fmt: skip


@pytest.mark.parametrize("wait_ms", ["nan", "inf", "-inf", "x"])
def test_a_wait_that_is_no_finite_number_is_refused(
    control: tuple[LeaseTable, str], wait_ms: str
) -> None:
    """Case 7: ``?wait_ms=nan`` parked a thread for good."""
    _, base = control
    auth = {"Authorization": "Bearer s3cret"}
    got = httpx.get(f"{base}/retained/r1?wait_ms={wait_ms}", headers=auth, timeout=3)
    assert got.status_code == 400


def test_the_control_server_bounds_its_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 7: 2,000 idle connections were 2,000 threads, all open after 30 s. Past the cap a
    new connection is closed at once; a silent one is closed after the idle timeout; the
    server keeps answering."""
    import socket

    from kvturn.connector import control_server

    monkeypatch.setattr(control_server, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(control_server, "IDLE_TIMEOUT_S", 1.0)
    table = LeaseTable(time.monotonic, max_lease_s=60)
    server = ControlServer(table, "127.0.0.1", 0, secret="s3cret").start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", server.port), timeout=3) as extra:
            assert extra.recv(10) == b""  # closed at once, unanswered
        time.sleep(1.5)  # the idle ones were closed
        for conn in idle:
            conn.settimeout(3)
            assert conn.recv(10) == b""
            conn.close()
        health = httpx.get(f"http://127.0.0.1:{server.port}/kvturn/health", timeout=3)
        assert health.json() == {"ok": True, "draining": False}
    finally:
        server.stop()


def test_control_channel_routes(control: tuple[LeaseTable, str]) -> None:
    table, base = control
    auth = {"Authorization": "Bearer s3cret"}
    _retain(table, 1, "a")
    _retain(table, 2, "b")
    got = httpx.get(f"{base}/retained/r1", headers=auth).json()
    assert got["remote_num_tokens"] == 64 and 19 < got["expires_in_s"] <= 20
    renewed = httpx.post(f"{base}/leases/r1/renew", headers=auth,
                         json={"lease_s": 45, "pause_kind": "tool", "paused_ms": 100})  # fmt: skip
    assert 44 < renewed.json()["expires_in_s"] <= 45
    for raw in (b'{"lease_s": 45, "paused_ms": 1' + b"0" * 400 + b"}", b'{"lease_s": 1e400}',
                b'{"lease_s": 45, "paused_ms": -1}', b'{"lease_s": -5}'):  # fmt: skip
        refused = httpx.post(f"{base}/leases/r1/renew", headers=auth, content=raw)
        assert refused.status_code == 400, raw  # a huge integer was an OverflowError
    bad = httpx.post(f"{base}/leases/r1/renew", headers=auth, json={"lease_s": "x"})
    assert bad.status_code == 400
    claimed = httpx.post(f"{base}/leases/r1/claim", headers=auth).json()
    # The prefill's own expiry check sees the lease's deadline, on this process's clock.
    assert claimed["remote_blocks_expiry_time"] == table.get("r1").expires_at  # type: ignore[union-attr]
    again = httpx.post(f"{base}/leases/r1/claim", headers=auth)
    assert again.status_code == 404
    released = httpx.delete(f"{base}/leases/r2", headers=auth).json()
    assert released == {"released": True}
    table.finished("chatcmpl-r2-0000abcd")
    gone = httpx.post(f"{base}/leases/r2/claim", headers=auth)
    assert gone.status_code == 404 and gone.json()["reason"] == "released"
    stats = httpx.get(f"{base}/leases", headers=auth).json()
    assert stats["retained"] == 2 and stats["ended"] == {"released": 1}
    assert "kvturn_block_size" not in stats  # the engine's facts, once the connector knows them
    table.engine = {"kvturn_block_size": 16, "kvturn_kv_bytes_per_token": 4096}
    stats = httpx.get(f"{base}/leases", headers=auth).json()
    assert stats["kvturn_block_size"] == 16 and stats["kvturn_kv_bytes_per_token"] == 4096
    identity = httpx.get(f"{base}/identity", headers=auth).json()
    assert identity == {
        "engine_id": "e-1", "side_channel_host": "10.0.0.3", "side_channel_port": 5600,
        "tp_size": 1, "pp_size": 1, "transfer_mode": "push",
    }  # fmt: skip


def test_the_control_routes_the_gateway_calls_are_the_ones_the_server_matches() -> None:
    from kvturn import wire

    for path, route in [
        (wire.retained_path("k é 1", 2.0), wire.RETAINED_ROUTE),
        (wire.claim_path("k é 1"), wire.CLAIM_ROUTE),
        (wire.renew_path("k é 1"), wire.RENEW_ROUTE),
        (wire.lease_path("k é 1", claimed=True), wire.LEASE_ROUTE),
        (wire.pushes_path("k é 1", 0.5), wire.PUSHES_ROUTE),
    ]:
        assert wire.match_control_route(path)[:2] == (route, "k é 1")
    assert wire.match_control_route(wire.retained_path("k", 2.0))[2] == {"wait_ms": ["2000"]}
    assert wire.claimed_flag(wire.match_control_route(wire.lease_path("k", claimed=True))[2])
    assert not wire.claimed_flag(wire.match_control_route(wire.lease_path("k"))[2])
    for path in (wire.HEALTH_PATH, wire.LEASES_PATH, wire.IDENTITY_PATH, wire.WAKE_PATH):
        assert wire.match_control_route(path) == (path, None, {})
    for stray in ("/kvturn/retained/", "/kvturn/leases/k/read", "/kvturn", "/other/leases"):
        assert wire.match_control_route(stray)[0] is None


def test_idle_pacing_is_short_then_long_and_a_wake_restarts_it() -> None:
    from kvturn.connector.engine_pacing import IdlePacer

    clock = FakeClock()
    pacer = IdlePacer(short_s=0.01, long_s=0.25, short_phase_s=2.0, clock=clock)
    assert pacer.next_wait(busy=True) == 0.0
    assert pacer.next_wait(busy=False) == 0.01
    clock.now += 2.5
    assert pacer.next_wait(busy=False) == 0.25
    pacer.wake()
    assert pacer.next_wait(busy=False) == 0.01
    clock.now += 2.5
    assert pacer.next_wait(busy=False) == 0.25
    assert pacer.next_wait(busy=True) == 0.0 and pacer.next_wait(busy=False) == 0.01
    # Expecting work no request brings (a push decode awaiting its KV): steps stay short.
    clock.now += 2.5
    assert pacer.next_wait(busy=False, expecting=True) == 0.01
    assert pacer.next_wait(busy=False) == 0.25
    # A wake ends a long wait early.
    sleepy = IdlePacer(short_s=5.0, long_s=5.0)
    threading.Timer(0.05, sleepy.wake).start()
    started = time.monotonic()
    sleepy.pace(busy=False)
    assert time.monotonic() - started < 2.5


def test_an_expected_request_makes_idle_steps_short_until_it_arrives() -> None:
    from kvturn.connector.engine_pacing import IdlePacer

    clock = FakeClock()
    pacer = IdlePacer(short_s=0.01, long_s=0.25, short_phase_s=2.0, clock=clock, soon_s=0.001)
    assert pacer.next_wait(busy=False) == 0.01
    clock.now += 2.5
    assert pacer.next_wait(busy=False) == 0.25  # long since idle
    pacer.expect(0.05)
    assert pacer.next_wait(busy=False) == 0.001
    clock.now += 0.03
    assert pacer.next_wait(busy=False) == 0.001
    clock.now += 0.03  # it never came: back to the short phase the wake began
    assert pacer.next_wait(busy=False) == 0.01
    pacer.expect(0.05)
    assert pacer.next_wait(busy=True) == 0.0  # it came
    assert pacer.next_wait(busy=False) == 0.01
    pacer.expect(60)  # at most a second
    clock.now += 1.5
    assert pacer.next_wait(busy=False) == 0.01


def test_steps_while_a_kv_read_is_in_flight_stay_close_however_long_the_engine_idled() -> None:
    from kvturn.connector.engine_pacing import IdlePacer

    clock = FakeClock()
    pacer = IdlePacer(short_s=0.01, long_s=0.25, short_phase_s=2.0, clock=clock, soon_s=0.001)
    assert pacer.next_wait(busy=False) == 0.01
    clock.now += 2.5
    assert pacer.next_wait(busy=False) == 0.25  # long since idle
    assert pacer.next_wait(busy=False, loading=True) == 0.001
    assert pacer.next_wait(busy=False, expecting=True, loading=True) == 0.001
    assert pacer.next_wait(busy=False) == 0.25  # the read landed and nothing came of it
    assert pacer.next_wait(busy=True, loading=True) == 0.0


def test_a_wake_that_says_when_the_request_arrives_is_passed_on() -> None:
    table = LeaseTable(time.monotonic, max_lease_s=60)
    woken: list[str] = []
    expected: list[float] = []
    server = ControlServer(
        table,
        "127.0.0.1",
        0,
        on_call=lambda: woken.append("wake"),
        on_expect=expected.append,
    ).start()
    try:
        base = f"http://127.0.0.1:{server.port}/kvturn"
        assert httpx.post(f"{base}/wake").json() == {"ok": True, "draining": False}
        assert httpx.post(f"{base}/wake", json={"within_ms": 50}).json() == {
            "ok": True,
            "draining": False,
        }
        assert httpx.post(f"{base}/wake", json={"within_ms": "soon"}).json() == {
            "ok": True,
            "draining": False,
        }
    finally:
        server.stop()
    assert woken == ["wake"] * 3 and expected == [0.05]


def test_leases_of_requests_another_proxy_drives_are_never_reclaimed() -> None:
    clock = FakeClock()
    table = _table(clock)
    table.retain("r1", "r1", "request:r1", {}, [[1, 2, 3]], 20.0, reclaimable=False)
    _retain(table, 2, "b")
    assert [lease.key for lease in table.reclaim(100)] == ["r2"]
    assert table.reclaim_order() == []


async def test_a_release_that_cannot_reach_its_decode_is_tried_again() -> None:
    import asyncio

    from kvturn.gateway.http.upstream import Upstream
    from kvturn.gateway.leases import LeaseClient

    calls: list[bytes] = []
    answers = [None, (200, b'{"released": true}'), (404, b'{"released": false}')]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        calls.append(head.split(b" ", 1)[0])
        answer = answers[min(len(calls), len(answers)) - 1]
        if answer is None:
            writer.transport.abort()  # unreachable, as far as the gateway can tell
            return
        status, body = answer
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    upstream = Upstream(1.0, 5.0, None)
    await upstream.start()
    try:
        leases = LeaseClient(upstream, "secret")
        assert await leases.release(url, "k1") is True
        assert calls == [b"DELETE", b"DELETE"]  # dropped once, then freed
        # A decode that answers "no such lease" is not asked again.
        assert await leases.release(url, "k2") is False
        assert len(calls) == 3
    finally:
        await upstream.close()
        server.close()
