"""The gateway's HTTP server tried as an attacker would, each case bounded in time and, where it
applies, with 100 normal clients served meanwhile: a head or a body trickled a byte at a time,
an endless header line, more connections than the cap, a client that leaves a non-streamed
turn, a pipelined ``Expect: 100-continue``, chunked trailers naming headers.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from tests import fake_engine
from tests.gateway_fixtures import running_fake_engine, running_gateway
from tests.unit.test_http_server import post, read_response

TURN = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
READ_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture(scope="module")
def gateway(fake_url: str) -> Iterator[tuple[str, int]]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]),
        read_timeout_s=READ_TIMEOUT_S, max_connections=300,
    )  # fmt: skip
    with running_gateway(config) as running:
        yield running.host, running.port


def _normal_clients(gateway: tuple[str, int], count: int = 100) -> list[int]:
    """``count`` ordinary turns, 20 at a time: their statuses."""

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            url = f"http://{gateway[0]}:{gateway[1]}/v1/chat/completions"
            answers = await asyncio.gather(
                *(client.post(url, content=TURN, headers={"content-type": "application/json"})
                  for _ in range(count))
            )  # fmt: skip
        return [a.status_code for a in answers]

    return asyncio.run(run())


def _meanwhile(attack: Callable[[], Any], gateway: tuple[str, int]) -> tuple[Any, list[int], float]:
    """Run ``attack`` on a thread while 100 normal clients are served; its result, their
    statuses, and how long they took."""
    result: dict[str, Any] = {}

    def attacker() -> None:
        try:
            result["value"] = attack()
        except BaseException as error:  # re-raised below
            result["error"] = error

    thread = threading.Thread(target=attacker)
    thread.start()
    time.sleep(0.2)  # the attack is under way
    started = time.monotonic()
    statuses = _normal_clients(gateway)
    took = time.monotonic() - started
    thread.join(60)
    assert not thread.is_alive(), "the attack did not end"
    if "error" in result:
        raise result["error"]
    return result.get("value"), statuses, took


def _trickle(gateway: tuple[str, int], data: bytes, sockets: int = 50) -> list[int]:
    """``sockets`` connections each sending ``data`` one byte every 0.1 s (never all of it in
    time): the status each gets, once the gateway ends it."""
    conns = [socket.create_connection(gateway, timeout=10) for _ in range(sockets)]
    statuses: list[int | None] = [None] * sockets
    deadline = time.monotonic() + 4 * READ_TIMEOUT_S + 5
    sent = 0
    while None in statuses and time.monotonic() < deadline:
        for i, conn in enumerate(conns):
            if statuses[i] is not None:
                continue
            try:
                if sent < len(data):
                    conn.send(data[sent : sent + 1])
                conn.setblocking(False)
                try:
                    head = conn.recv(65536)
                except BlockingIOError:
                    head = None
                finally:
                    conn.setblocking(True)
                if head is not None:
                    statuses[i] = int(head.split()[1]) if head else 0
            except OSError:
                statuses[i] = 0  # reset: ended all the same
        sent += 1
        time.sleep(0.1)
    for conn in conns:
        conn.close()
    return [s if s is not None else -1 for s in statuses]


def test_a_trickled_head_gets_a_408_and_others_are_served(gateway: tuple[str, int]) -> None:
    head = post(TURN)[: -len(TURN)] * 1  # never completes within the deadline at 10 bytes/s
    started = time.monotonic()
    statuses, normal, took = _meanwhile(lambda: _trickle(gateway, head), gateway)
    assert statuses == [408] * 50, statuses
    assert time.monotonic() - started < 4 * READ_TIMEOUT_S + 5
    assert normal == [200] * 100 and took < 30


def test_a_trickled_body_gets_a_408(gateway: tuple[str, int]) -> None:
    complete_head = post(TURN)[: -len(TURN)]
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(complete_head + TURN[:5])
        started = time.monotonic()
        status, _, body = read_response(conn, bytearray())
        assert status == 408 and b"not received within" in body
        assert READ_TIMEOUT_S * 0.8 <= time.monotonic() - started < READ_TIMEOUT_S + 5
        assert conn.recv(100) == b""  # closed


def test_an_endless_header_line_is_cut_off_at_the_limit(gateway: tuple[str, int]) -> None:
    def attack() -> tuple[int, int]:
        with socket.create_connection(gateway, timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nx-long: ")
            sent = 0
            try:
                while sent < 64 * 1024 * 1024:
                    conn.sendall(b"a" * 65536)
                    sent += 65536
            except OSError:
                pass  # the gateway answered and closed: the rest of the line cannot go in
            status, _, _ = read_response(conn, bytearray())
            return status, sent

    (status, sent), normal, took = _meanwhile(attack, gateway)
    assert status == 431
    assert sent < 16 * 1024 * 1024, sent  # cut off long before 64 MB went in
    assert normal == [200] * 100 and took < 30


def test_connections_past_the_cap_get_a_503_and_served_ones_go_on(
    fake_url: str,
) -> None:
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]),
        max_connections=20,
    )  # fmt: skip
    with running_gateway(config) as running:
        address = (running.host, running.port)
        held = [socket.create_connection(address, timeout=10) for _ in range(20)]
        try:
            with socket.create_connection(address, timeout=10) as extra:
                status, _, body = read_response(extra, bytearray())
                assert status == 503 and b"server_busy" in body
            # One of the held connections is served as usual.
            held[0].sendall(post(TURN))
            assert read_response(held[0], bytearray())[0] == 200
        finally:
            for conn in held:
                conn.close()
        time.sleep(0.3)
        assert httpx.get(running.url + "/health", timeout=10).status_code == 200


def test_a_client_leaving_a_non_streamed_turn_cancels_its_engine_request(
    gateway: tuple[str, int],
) -> None:
    before = fake_engine.COUNTS.get("abandoned_requests", 0)
    slow = orjson.dumps({**orjson.loads(TURN), "fake_delay_ms": 5000})
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(post(slow))
        time.sleep(0.5)  # the gateway's prefill request is waiting on the engine
    deadline = time.monotonic() + 4
    while fake_engine.COUNTS.get("abandoned_requests", 0) == before:
        assert time.monotonic() < deadline, "the engine request ran on after the client left"
        time.sleep(0.05)


def test_a_pipelined_expect_continue_gets_its_100_after_the_replies_before_it(
    gateway: tuple[str, int],
) -> None:
    slow = orjson.dumps({**orjson.loads(TURN), "fake_delay_ms": 300})
    with socket.create_connection(gateway, timeout=10) as conn:
        expecting = post(TURN, extra="expect: 100-continue\r\n")
        conn.sendall(post(slow) + expecting[: -len(TURN)])  # its body waits for the 100
        buffer = bytearray()
        assert read_response(conn, buffer)[0] == 200  # the first reply, first
        while b"\r\n\r\n" not in buffer:
            buffer += conn.recv(65536)
        assert bytes(buffer).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del buffer[: len(b"HTTP/1.1 100 Continue\r\n\r\n")]
        conn.sendall(TURN)
        assert read_response(conn, buffer)[0] == 200


def test_chunked_trailers_cannot_set_headers(gateway: tuple[str, int]) -> None:
    body = b"%x\r\n%s\r\n0\r\nX-Conversation-Id: from-a-trailer\r\n\r\n" % (len(TURN), TURN)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(head + body)
        status, headers, _ = read_response(conn, bytearray())
    assert status == 200
    assert headers.get("x-conversation-id", "").startswith("implicit-")  # not the trailer's


def test_the_connection_cap_stays_under_the_file_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    from kvturn.gateway.http import server as http_server

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert http_server._connection_cap(4096) == 1024 - http_server._FD_RESERVE
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (65536, 65536))
    assert http_server._connection_cap(4096) == 4096


def _rest(conn: socket.socket, buffer: bytearray) -> bytes:
    """Whatever else the connection sends until the gateway closes it (or 2 s pass)."""
    conn.settimeout(2)
    try:
        while data := conn.recv(65536):
            buffer += data
    except TimeoutError:
        return bytes(buffer) + b"<still open>"
    return bytes(buffer)


def test_an_upgrade_on_a_get_gets_one_answer(gateway: tuple[str, int]) -> None:
    """Issue #39, case 8: ``Upgrade: websocket`` on a GET was answered 200, then with a 400
    nobody asked for. The upgrade is ignored (HTTP allows it): one answer, then the close."""
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(
            b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        buffer = bytearray()
        assert read_response(conn, buffer)[0] == 200
        assert _rest(conn, buffer) == b""


def test_a_pipelined_expect_continue_whose_body_came_gets_no_stray_100(
    gateway: tuple[str, int],
) -> None:
    """Case 8: its body already there, a 100 after its reply was a stray response."""
    slow = orjson.dumps({**orjson.loads(TURN), "fake_delay_ms": 300})
    with socket.create_connection(gateway, timeout=10) as conn:
        expecting = post(TURN, extra="expect: 100-continue\r\n")
        conn.sendall(post(slow) + expecting)  # not waiting for the 100: the body is there
        buffer = bytearray()
        assert read_response(conn, buffer)[0] == 200
        assert read_response(conn, buffer)[0] == 200
        assert _rest(conn, buffer) == b"<still open>"  # nothing more: kept alive, idle


def test_a_half_closed_client_still_gets_its_whole_stream(gateway: tuple[str, int]) -> None:
    """Case 8: a client that closed its sending side (``SHUT_WR``) had the stream it was still
    reading aborted. Once a reply has begun it goes on to its end. (Before any reply, a
    closed side is all TCP shows of a client that left: its turn is cancelled, as Go's
    net/http does too; see the test of a client leaving a non-streamed turn.)"""
    # The engine ends its stream 0.5 s after its last event: the client half-closes before.
    streamed = orjson.dumps({**orjson.loads(TURN), "stream": True, "fake_end_delay_ms": 500})
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(post(streamed))
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            buffer += conn.recv(65536)
        assert buffer.startswith(b"HTTP/1.1 200")
        conn.shutdown(socket.SHUT_WR)
        rest = _rest(conn, buffer)
        assert b"data: [DONE]" in rest and rest.endswith(b"\r\n0\r\n\r\n"), rest[-120:]


def test_a_client_that_closes_between_requests_is_let_go_at_once(
    gateway: tuple[str, int],
) -> None:
    """Its closed side ends the connection: it is not kept half open until the keep-alive
    runs out."""
    with socket.create_connection(gateway, timeout=10) as conn:
        conn.sendall(post(TURN))
        buffer = bytearray()
        assert read_response(conn, buffer)[0] == 200
        conn.shutdown(socket.SHUT_WR)
        assert _rest(conn, buffer) == b""
