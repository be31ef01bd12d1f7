"""The gateway's HTTP/1.1 server at the byte level: keep-alive, pipelining, limits, HTTP/1.0,
100-continue, HEAD, idle timeout, graceful stop. The fake engine answers the turns."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from tests.gateway_fixtures import running_fake_engine, running_gateway

TURN = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture(scope="module")
def gateway(fake_url: str) -> Iterator[tuple[str, int]]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]),
        max_body_bytes=4096,
    )  # fmt: skip
    with running_gateway(config) as running:
        yield running.host, running.port


def post(body: bytes = TURN, path: str = "/v1/chat/completions", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off ``sock`` (Content-Length, chunked, or until close)."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed before a response head: {bytes(buffer)!r}")
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    buffer[:] = rest
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(buffer) < length:
            buffer += sock.recv(65536)
        body = bytes(buffer[:length])
        buffer[:] = buffer[length:]
        return status, headers, body
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buffer:
                buffer += sock.recv(65536)
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += sock.recv(65536)
            body += rest[:size]
            buffer[:] = rest[size + 2 :]
            if size == 0:
                return status, headers, body
    while data := sock.recv(65536):
        buffer += data
    body, buffer[:] = bytes(buffer), b""
    return status, headers, body


def connect(gateway: tuple[str, int]) -> socket.socket:
    return socket.create_connection(gateway, timeout=10)


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_and_pipelined_requests_answer_in_order(gateway: tuple[str, int]) -> None:
    with connect(gateway) as sock:
        buffer = bytearray()
        # Three requests in one write: a turn, a models lookup, and a bad turn.
        sock.sendall(
            post() + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" + post(b'{"model": "fake"')
        )
        first = read_response(sock, buffer)
        second = read_response(sock, buffer)
        third = read_response(sock, buffer)
        assert first[0] == 200 and orjson.loads(first[2])["object"] == "chat.completion"
        assert first[1]["x-kvturn-plan"] == "recompute"
        assert "date" in first[1]
        assert second[0] == 200 and orjson.loads(second[2])["data"][0]["id"] == "fake"
        assert third[0] == 400 and "not valid JSON" in orjson.loads(third[2])["error"]["message"]
        # Still open for more.
        sock.sendall(post())
        assert read_response(sock, buffer)[0] == 200


def test_a_streamed_turn_is_framed_server_sent_events(gateway: tuple[str, int]) -> None:
    body = orjson.dumps({**orjson.loads(TURN), "stream": True})
    with connect(gateway) as sock:
        buffer = bytearray()
        sock.sendall(post(body))
        status, headers, payload = read_response(sock, buffer)
    assert status == 200
    # Chunked as it arrives; a stream that arrived whole leaves in one write, with its length.
    if "transfer-encoding" in headers:
        assert headers["transfer-encoding"] == "chunked"
    else:
        assert int(headers["content-length"]) == len(payload)
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    assert payload.endswith(b"data: [DONE]\n\n")


def test_http10_client_gets_its_answer_and_the_connection_closes(
    gateway: tuple[str, int],
) -> None:
    body = orjson.dumps({**orjson.loads(TURN), "stream": True})
    with connect(gateway) as sock:
        buffer = bytearray()
        sock.sendall(post(body).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, headers, payload = read_response(sock, buffer)
    assert status == 200
    assert "transfer-encoding" not in headers  # HTTP/1.0 has no chunked encoding
    assert headers["connection"] == "close"
    assert payload.endswith(b"data: [DONE]\n\n")


def test_oversized_bodies_are_refused_with_413(gateway: tuple[str, int]) -> None:
    big = b'{"model": "fake", "messages": [], "pad": "' + b"x" * 5000 + b'"}'
    with connect(gateway) as sock:
        sock.sendall(post(big))
        status, _, body = read_response(sock, bytearray())
        assert status == 413
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
        assert closed_by_peer(sock)
    # Chunked: no length up front, refused once it grows past the limit.
    chunk = b"x" * 3000
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    with connect(gateway) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + framed
        )
        assert read_response(sock, bytearray())[0] == 413


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_still_sending_a_refused_body_reads_the_refusal(
    gateway: tuple[str, int], framing: str
) -> None:
    """Refused mid-body (413 here; a caller past its body budget gets 429 the same way), the
    client may still be sending: the connection closes lingering, its bytes read and dropped,
    so the client finishes sending and reads the answer instead of a reset (a reset is a
    connection error to the SDKs, not the 413 or 429 they act on)."""
    body = b"x" * (16 * 1024 * 1024)  # far more than the socket buffers between us hold
    if framing == "content-length":
        request = post(body)
    else:
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
            b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
    with connect(gateway) as sock:
        sock.sendall(request)  # a reset would raise here
        status, _, answer = read_response(sock, bytearray())
        assert status == 413
        assert orjson.loads(answer)["error"]["code"] == "request_too_large"
        assert closed_by_peer(sock)


def test_oversized_head_is_refused_with_431(gateway: tuple[str, int]) -> None:
    with connect(gateway) as sock:
        sock.sendall(post(extra=f"x-big: {'y' * 70_000}\r\n"))
        status, _, body = read_response(sock, bytearray())
    assert status == 431
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"


def test_malformed_request_is_a_400_and_closes(gateway: tuple[str, int]) -> None:
    with connect(gateway) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        status, _, body = read_response(sock, bytearray())
        assert status == 400
        assert "malformed" in orjson.loads(body)["error"]["message"]
        assert closed_by_peer(sock)


def test_expect_100_continue(gateway: tuple[str, int]) -> None:
    with connect(gateway) as sock:
        head = post(extra="expect: 100-continue\r\n")[: -len(TURN)]
        sock.sendall(head)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(TURN)
        assert read_response(sock, bytearray())[0] == 200


def test_head_request_has_no_body(gateway: tuple[str, int]) -> None:
    with connect(gateway) as sock:
        buffer = bytearray()
        sock.sendall(b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        while b"\r\n\r\n" not in buffer:
            buffer += sock.recv(65536)
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        # What follows the HEAD response's head is the next response, not a body.
        buffer[:] = rest
        status, _, body = read_response(sock, buffer)
        assert status == 200 and orjson.loads(body)["ok"] is True


def test_asgi_routes_get_openai_errors(gateway: tuple[str, int]) -> None:
    base = f"http://{gateway[0]}:{gateway[1]}"
    missing = httpx.get(base + "/v1/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(base + "/metrics").text.startswith("# HELP")


class _Observed:
    """An operator's ASGI middleware: counts the lifespan events it sees and tags every
    response with the path it answered."""

    lifespan_events: list[str] = []

    def __init__(self, app: object):
        self.app = app

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "lifespan":

            async def observed_receive() -> dict:
                message = await receive()  # type: ignore[operator]
                _Observed.lifespan_events.append(message["type"])
                return message

            await self.app(scope, observed_receive, send)  # type: ignore[operator]
            return

        async def tagged_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                tag = (b"x-observed", scope["path"].encode())
                message = {**message, "headers": [*message.get("headers", []), tag]}
            await send(message)  # type: ignore[operator]

        await self.app(scope, receive, tagged_send)  # type: ignore[operator]


def test_turns_pass_through_the_apps_lifespan_and_middleware(fake_url: str) -> None:
    import asyncio

    from kvturn.gateway.app import create_app
    from kvturn.gateway.http.server import HttpServer

    async def scenario() -> list[httpx.Response]:
        config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url]))
        app = create_app(config)
        app.add_middleware(_Observed)
        server = HttpServer(app, port=0)
        await server.start()
        try:
            assert _Observed.lifespan_events == ["lifespan.startup"]
            base = f"http://127.0.0.1:{server.port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                turn = {**orjson.loads(TURN)}
                return [
                    await client.post("/v1/chat/completions", json=turn),
                    await client.post("/v1/chat/completions", json={**turn, "stream": True}),
                    await client.get("/health"),
                ]
        finally:
            await server.stop()

    _Observed.lifespan_events.clear()
    plain, streamed, health = asyncio.run(scenario())
    assert _Observed.lifespan_events == ["lifespan.startup", "lifespan.shutdown"]
    assert plain.status_code == 200 and plain.json()["object"] == "chat.completion"
    assert plain.headers["x-observed"] == "/v1/chat/completions"
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert streamed.headers["x-observed"] == "/v1/chat/completions"
    assert health.headers["x-observed"] == "/health"


def test_idle_connections_are_closed(fake_url: str) -> None:
    import asyncio

    from kvturn.gateway.app import create_app
    from kvturn.gateway.http.server import HttpServer
    from kvturn.gateway.server import server_limits

    async def scenario() -> bool:
        config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url]))
        limits = dataclasses.replace(server_limits(config), keep_alive_s=0.2)
        server = HttpServer(create_app(config), port=0, limits=limits)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            started = time.monotonic()
            while await reader.read(65536):  # the body, then EOF once the idle timeout hits
                pass
            return time.monotonic() - started < 5  # 25x the timeout: a loaded machine is slow
        finally:
            await server.stop()

    assert asyncio.run(scenario())


def test_graceful_stop_lets_in_flight_requests_finish(fake_url: str) -> None:
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url]))
    with running_gateway(config) as running:
        answers: list[int] = []
        body = {**orjson.loads(TURN), "fake_delay_ms": 1500}  # per engine call: 3 s a turn

        def slow_turn() -> None:
            url = running.url + "/v1/chat/completions"
            answers.append(httpx.post(url, json=body, timeout=30).status_code)

        thread = threading.Thread(target=slow_turn)
        thread.start()
        time.sleep(1.0)  # the turn is in flight (it takes 3 s)
        running.stop()
        thread.join(30)
        assert answers == [200]
        with pytest.raises(httpx.ConnectError):
            httpx.get(running.url + "/health")


def test_the_servers_default_limits_are_the_gateways() -> None:
    """The server takes its limits as arguments (it reads no configuration); the gateway
    passes its own, and the server's defaults are the same values (but for the check of a
    request's head, which only the gateway knows)."""
    from kvturn.gateway.http.server import ServerLimits
    from kvturn.gateway.server import server_limits

    gateways = server_limits(GatewayConfig())
    assert gateways.admit is not None
    assert dataclasses.replace(gateways, admit=None) == ServerLimits()
    config = GatewayConfig(max_body_bytes=10, body_budget_bytes=20, read_timeout_s=3.0)
    limits = server_limits(dataclasses.replace(config, max_connections=40))
    assert (limits.max_body_bytes, limits.body_budget_bytes) == (10, 20)
    assert (limits.read_timeout_s, limits.max_connections) == (3.0, 40)
