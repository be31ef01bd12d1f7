"""A fast fake vLLM engine for router-overhead benchmarks: both P/D roles, canned answers.

    .venv/bin/python benchmarks/fast_upstream.py --port 29001

It speaks the same protocol as ``tests/fake_engine.py`` (prefill when the request carries
``do_remote_decode``, otherwise decode, streamed or not; what decode "retains" is published on
``/kvturn/retained/{X-Request-Id}``, and handed back in a conversation turn's non-streamed
reply as its ``kv_transfer_params``, and answers claims, renewals and releases of it like the
kvturn connector; ``/metrics`` like one vLLM
engine; ``/fake/counts``), but as a bare asyncio protocol on uvloop with httptools and
pre-encoded answers, so that one request costs it a few tens of microseconds. Against the
ASGI fake the fake itself was the bottleneck (about 2,700 P/D exchanges/s on these 2 cores),
which hid what the routers under test cost. Benchmarks only: tests use the ASGI fake.
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import orjson
import uvloop

from kvturn.wire import PREFIX_DIGESTS_KEY, PROMPT_TOKENS_KEY, prefix_digests

PROMPT_TOKENS = 1000

_COUNTS = {"prefill": 0, "decode": 0}
_RETAINED: dict[bytes, bytes] = {}
_RETAINED_MAX = 10_000


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}[status]
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, content_type, len(body))
        + body
    )


def _completion(request_id: str, cached: int = 0, params: dict | None = None) -> dict:
    answer = {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2,
                  "total_tokens": PROMPT_TOKENS + 2,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }  # fmt: skip
    if params is not None:
        answer["kv_transfer_params"] = params
    return answer


_PREFILL_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
    "remote_engine_id": "fake-p", "remote_request_id": "p", "remote_host": "localhost",
    "remote_port": 1, "remote_num_tokens": PROMPT_TOKENS, "tp_size": 1,
}  # fmt: skip
_PREFILL = _response(200, orjson.dumps(_completion("prefill", 0, _PREFILL_PARAMS)))
_PREFILL_REUSED = _response(
    200, orjson.dumps(_completion("prefill", PROMPT_TOKENS - 8, _PREFILL_PARAMS))
)
_DECODE = _response(200, orjson.dumps(_completion("decode")))


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _sse(piece: str, finish: str | None) -> bytes:
    choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
    chunk = {"id": "decode", "object": "chat.completion.chunk", "created": 0, "model": "fake",
             "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


_DECODE_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + _chunked(_sse("o", None), _sse("k", "stop"), b"data: [DONE]\n\n")
)
_METRICS = _response(
    200,
    "".join(
        f'# TYPE vllm:{name} gauge\nvllm:{name}{{engine="0",model_name="fake"}} 0.0\n'
        for name in ("num_requests_running", "num_requests_waiting")
    ).encode(),
    b"text/plain; version=0.0.4",
)
_GETS = {
    b"/health": _response(200, b"{}"),
    b"/v1/models": _response(
        200, orjson.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]})
    ),
    b"/metrics": _METRICS,
}
_NOT_FOUND = _response(404, b'{"error":"not found"}')


_HELD_DIGESTS = prefix_digests([*range(PROMPT_TOKENS), 0])


def _retained(request_id: bytes) -> dict:
    return {
        "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "fake-d",
        "remote_request_id": request_id.decode(), "remote_host": "localhost", "remote_port": 2,
        "remote_num_tokens": PROMPT_TOKENS + 1, "expires_in_s": 300.0,
        PREFIX_DIGESTS_KEY: _HELD_DIGESTS, PROMPT_TOKENS_KEY: PROMPT_TOKENS,
    }  # fmt: skip


_OK = _response(200, b"{}")
_GONE = _response(404, b'{"error":"no live lease","reason":"unknown"}')


def _lease_answer(method: bytes, path: bytes) -> bytes:
    """The connector's lease routes, as the gateway uses them: a claim takes the retained KV
    (single use), a renew answers a fresh lease, a DELETE frees it, a wake is a no-op."""
    parts = path.strip(b"/").split(b"/")
    if len(parts) < 3:  # /kvturn/wake, /kvturn/leases
        return _OK
    key = parts[2]
    if method == b"DELETE":
        return _response(200, b'{"released":%s}' % (b"true" if _RETAINED.pop(key, 0) else b"false"))
    if parts[-1] == b"claim":
        found = _RETAINED.pop(key, None)
        return _response(200, found) if found else _GONE
    return _response(200, b'{"expires_in_s":300.0}') if key in _RETAINED else _GONE


class FakeEngine(asyncio.Protocol):
    """Answers each request as soon as it is complete (in order, so pipelining works)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.request_id = b"none"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.request_id = b"none"

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self.request_id = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(self._answer())
        if not self.parser.should_keep_alive():
            self.transport.close()

    def _answer(self) -> bytes:
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"GET":
            if path in _GETS:
                return _GETS[path]
            if path == b"/fake/counts":
                return _response(200, orjson.dumps(_COUNTS))
            if path.startswith(b"/kvturn/retained/"):
                found = _RETAINED.get(path.rsplit(b"/", 1)[1])
                return _response(200, found) if found else _NOT_FOUND
            return _NOT_FOUND
        if path.startswith(b"/kvturn/"):
            return _lease_answer(method, path)
        if method != b"POST":
            return _NOT_FOUND
        request = orjson.loads(b"".join(self.body))
        params = request.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            _COUNTS["prefill"] += 1
            return _PREFILL if params.get("remote_block_ids") is None else _PREFILL_REUSED
        _COUNTS["decode"] += 1
        retained = _retained(self.request_id)
        _RETAINED[self.request_id] = orjson.dumps(retained)
        if len(_RETAINED) > _RETAINED_MAX:
            del _RETAINED[next(iter(_RETAINED))]
        if request.get("stream"):
            return _DECODE_STREAM
        if params.get("kvturn_conversation"):  # as vLLM hands back request_finished's params
            return _response(200, orjson.dumps(_completion("decode", 0, retained)))
        return _DECODE


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FakeEngine, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=29001)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
