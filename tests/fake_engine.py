"""A fast stand-in for a vLLM engine speaking the P/D protocol: for narrow gateway tests and
the gateway-overhead benchmark only. It never proves reuse works (the engine tests do that).

One raw ASGI app plays both roles: with ``do_remote_decode`` in the request it answers like a
prefill (``kv_transfer_params`` for decode); otherwise like a decode (a short reply, streamed or
not) and publishes "retained KV" on ``/kvturn/retained/{id}`` like the kvturn connector (a
non-streamed reply of a conversation's turn carries the same as its ``kv_transfer_params``, as
vLLM hands back what the connector's ``request_finished`` returns).
``/metrics`` answers like one vLLM engine (vllm-router reads it at start-up to count DP ranks);
``/fake/counts`` says how many prefill and decode requests it served (to check a router's
P/D routing), and how many slow streams (``fake_slow_stream``: one chunk per 20 ms) their
reader abandoned; any other GET is a 404. ``in_flight`` and ``peak_in_flight`` count the
``/v1`` POSTs (engine requests) being served at once, now and at most (a test resets the
peak).

``/tokenize`` answers only for chats whose first message starts with ``local:`` (so the
gateway's planner can choose ``decode-local``; every other chat plans a pull, as before): the
prompt is :data:`_PROMPT_TOKENS` tokens whose first ones are what a decode publishes it holds
(and 5000 tokens more for a chat whose first message starts with ``local-long:``: a prompt
longer than its messages' bytes bound, as no real template renders).
A decode request on a port in :data:`FAIL_DECODE_PORTS` gets a 500; a lease route on a port in
:data:`SILENT_CONTROL_PORTS` answers only after :data:`SILENT_S` (a control server that went
quiet while its engine still answers health checks). ``decode:<port>`` in the counts: the decode
requests each port served.

Push mode, as far as the gateway sees it: ``/kvturn/identity`` names the engine
(``fake-push-<port>``); a decode request with ``do_remote_prefill`` from such an engine waits
(like a real push decode) until a prefill request with the same ``X-Request-Id`` has answered
200, and waits on for good, until its client leaves (counted as ``push_abandoned``), if that
prefill failed. A prefill on a port in :data:`FAIL_PREFILL_PORTS` answers 500; one on a port in
:data:`LOSE_WRITE_PORTS` answers 200 but its write never arrives. ``/kvturn/pushes/{id}``
says whether a push decode still awaits its KV.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs

from kvturn.wire import PREFILL_CACHED_KEY, PREFIX_DIGESTS_KEY, PROMPT_TOKENS_KEY, prefix_digests

Scope = dict[str, Any]

_RETAINED: dict[str, dict[str, Any]] = {}
_THROTTLED: set[str] = set()
_CONVERSATIONS: set[str] = set()
COUNTS = {"prefill": 0, "decode": 0, "abandoned": 0, "in_flight": 0, "peak_in_flight": 0}
#: When set, /v1 POSTs need ``Authorization: Bearer <this>`` (as vLLM's ``--api-key``).
REQUIRED_KEY: str | None = None
#: The ``cache_salt`` of the last prefill and the last decode request (tenant isolation tests).
LAST_CACHE_SALT: dict[str, str | None] = {"prefill": None, "decode": None}
#: The request id and trace headers of the last prefill and the last decode request.
LAST_HEADERS: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
#: The lease the gateway last asked for: with a decode request (``retain``) and a renewal.
LAST_LEASE_ASKED: dict[str, float | None] = {"retain": None, "renew": None}
_RECORDED_HEADERS = (b"x-request-id", b"traceparent", b"tracestate")
_PROMPT_TOKENS = 1000
#: Ports whose decode requests fail with a 500 (a decode that broke).
FAIL_DECODE_PORTS: set[int] = set()
#: Ports whose streamed decode replies are a role, then an error event (vLLM's answer when
#: decode's read of the prompt's KV fails: 200 at once, the failure inside the stream).
ERROR_STREAM_DECODE_PORTS: set[int] = set()
#: Ports whose lease routes stay silent for SILENT_S seconds (past the gateway's 2 s).
SILENT_CONTROL_PORTS: set[int] = set()
SILENT_S = 4.0
#: Ports whose prefill requests fail with a 500 (push mode: the registration is never written).
FAIL_PREFILL_PORTS: set[int] = set()
#: Ports whose prefills answer 200 but whose writes never reach decode.
LOSE_WRITE_PORTS: set[int] = set()
#: Prompt tokens prefill says its own prefix cache served (the connector's
#: ``kvturn_prefill_cached_tokens``); None: it says nothing, as an older engine.
PREFILL_OWN_CACHED: int | None = None
#: Push mode: X-Request-Id -> whether its prefill's KV was written to decode.
_PUSHED: dict[str, bool] = {}
#: Push mode: X-Request-Id -> "awaiting" or "arrived", as a push decode says.
_PUSH_STATE: dict[str, str] = {}
#: What every fake decode says it holds: the prompt's tokens and one more.
_HELD_DIGESTS = prefix_digests([*range(_PROMPT_TOKENS), 0])
_METRICS = "".join(
    f'# TYPE vllm:{name} gauge\nvllm:{name}{{engine="0",model_name="fake"}} 0.0\n'
    for name in ("num_requests_running", "num_requests_waiting")
)


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_json(
    send: Any, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": data})


def _completion(request_id: str, stream_chunk: bool = False) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": _PROMPT_TOKENS, "completion_tokens": 2,
                  "total_tokens": _PROMPT_TOKENS + 2,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }  # fmt: skip


def _tool_call(name: str) -> dict[str, Any]:
    return {"id": "call_fake1", "type": "function",
            "function": {"name": name, "arguments": '{"x": 1}'}}  # fmt: skip


async def app(scope: Scope, receive: Any, send: Any) -> None:
    """The engine; its ``/v1`` POSTs counted while they are served (``in_flight``)."""
    if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1"):
        await _serve(scope, receive, send)
        return
    COUNTS["in_flight"] += 1
    COUNTS["peak_in_flight"] = max(COUNTS["peak_in_flight"], COUNTS["in_flight"])
    try:
        await _serve(scope, receive, send)
    finally:
        COUNTS["in_flight"] -= 1


async def _serve(scope: Scope, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    if path == "/health":
        await _send_json(send, 200, {})
        return
    if path == "/v1/models":
        await _send_json(send, 200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        return
    if path == "/metrics":  # Prometheus text, one engine (rank 0), as vLLM serves it
        data = _METRICS.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4"),
                                (b"content-length", str(len(data)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})
        return
    if path == "/fake/counts":
        await _send_json(send, 200, COUNTS)
        return
    if path.startswith("/kvturn/retained/"):
        COUNTS["retained_asked"] = COUNTS.get("retained_asked", 0) + 1
        found = _RETAINED.get(path.rsplit("/", 1)[1])
        await _send_json(send, 200 if found else 404, found or {"error": "none"})
        return
    if path == "/kvturn/wake" and scope["method"] == "POST":
        within = json.loads(await _read(receive) or b"{}").get("within_ms")
        if within is not None:  # a request said to be on its way
            COUNTS["expected"] = COUNTS.get("expected", 0) + 1
        else:
            COUNTS["woken"] = COUNTS.get("woken", 0) + 1
        await _send_json(send, 200, {})
        return
    if path.startswith("/kvturn/leases"):
        if scope["server"][1] in SILENT_CONTROL_PORTS:
            await asyncio.sleep(SILENT_S)
        await _lease_route(scope, path, receive, send)
        return
    if path.startswith("/kvturn/pushes/"):
        key = path.rsplit("/", 1)[1]
        wait_s = float(parse_qs(scope.get("query_string", b"").decode()).get("wait_ms", ["0"])[0])
        deadline = asyncio.get_running_loop().time() + wait_s / 1000
        while _PUSH_STATE.get(key) != "arrived" and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        await _send_json(send, 200, {"state": _PUSH_STATE.get(key, "unknown")})
        return
    if path == "/kvturn/identity":
        port = scope["server"][1]
        identity = {"engine_id": f"fake-push-{port}", "side_channel_port": port, "tp_size": 1}
        await _send_json(send, 200, identity)
        return
    if scope["method"] != "POST":
        await _send_json(send, 404, {"error": "not found"})
        return
    if path == "/tokenize":
        request = json.loads(await _read(receive))
        first = (request.get("messages") or [{}])[0].get("content") or ""
        if not str(first).startswith(("local:", "local-long:")):
            await _send_json(send, 404, {"error": "not found"})
            return
        COUNTS["tokenize"] = COUNTS.get("tokenize", 0) + 1
        where = f"tokenize:{scope['server'][1]}"  # which engine (port) was asked
        COUNTS[where] = COUNTS.get(where, 0) + 1
        tokens = list(range(_PROMPT_TOKENS))
        if str(first).startswith("local-long:"):
            tokens += [0] * 5000
        await _send_json(send, 200, {"count": len(tokens), "tokens": tokens})
        return
    authorization = dict(scope["headers"]).get(b"authorization")
    if REQUIRED_KEY is not None and authorization != f"Bearer {REQUIRED_KEY}".encode():
        await _send_json(send, 401, {"error": {"message": "Unauthorized", "type": "x",
                                               "param": None, "code": None}})  # fmt: skip
        return
    body = json.loads(await _read(receive))
    delay_s = (body.get("fake_delay_ms") or 0) / 1000  # lets a test hold requests in flight
    if delay_s and not await _wait_unless_abandoned(delay_s, receive):
        COUNTS["abandoned_requests"] = COUNTS.get("abandoned_requests", 0) + 1
        return
    if body.get("fake_429_once"):  # the first attempt of each distinct request is throttled
        key = body["fake_429_once"]
        if key not in _THROTTLED:
            _THROTTLED.add(key)
            await _send_json(send, 429, {"error": {"message": "slow down", "type": "rate_limit"}})
            return
    params = body.get("kv_transfer_params") or {}
    request_id = dict(scope["headers"]).get(b"x-request-id", b"none").decode()
    if params.get("do_remote_decode") and scope["server"][1] in FAIL_PREFILL_PORTS:
        _PUSHED[request_id] = False
        await _send_json(send, 500, {"error": {"message": "prefill broke", "type": "x"}})
        return
    if params.get("do_remote_decode"):
        _PUSHED[request_id] = scope["server"][1] not in LOSE_WRITE_PORTS
        COUNTS["prefill"] += 1
        where = f"prefill:{scope['server'][1]}"  # which engine (port) prefilled
        COUNTS[where] = COUNTS.get(where, 0) + 1
        LAST_CACHE_SALT["prefill"] = body.get("cache_salt")
        LAST_HEADERS["prefill"] = _recorded(scope)
        reused = 0 if params.get("remote_block_ids") is None else _PROMPT_TOKENS - 8
        answer = _completion("prefill")
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] = reused
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "fake-p", "remote_request_id": "p", "remote_host": "localhost",
            "remote_port": 1, "remote_num_tokens": _PROMPT_TOKENS, "tp_size": 1,
        }  # fmt: skip
        if PREFILL_OWN_CACHED is not None:  # as kvturn's connector reports them
            cached = max(reused, PREFILL_OWN_CACHED)
            answer["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
            answer["kv_transfer_params"][PREFILL_CACHED_KEY] = PREFILL_OWN_CACHED
        await _send_json(send, 200, answer)
        return
    if scope["server"][1] in FAIL_DECODE_PORTS:
        await _send_json(send, 500, {"error": {"message": "decode broke", "type": "x"}})
        return
    if scope["server"][1] in ERROR_STREAM_DECODE_PORTS and body.get("stream"):
        COUNTS["error_streams"] = COUNTS.get("error_streams", 0) + 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        role = {"id": request_id, "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None}]}  # fmt: skip
        error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                           "param": None, "code": 500}}  # fmt: skip
        for event in (f"data: {json.dumps(role)}\n\n", f"data: {json.dumps(error)}\n\n",
                      "data: [DONE]\n\n"):  # fmt: skip
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    push = str(params.get("remote_engine_id")).startswith("fake-push-")
    if params.get("do_remote_prefill") and push:
        # A push decode: it registered its blocks; it goes on once the prefill has written.
        _PUSH_STATE[request_id] = "awaiting"
        while not _PUSHED.get(request_id):
            if not await _wait_unless_abandoned(0.005, receive):
                COUNTS["push_abandoned"] = COUNTS.get("push_abandoned", 0) + 1
                return
        _PUSH_STATE[request_id] = "arrived"
    COUNTS["decode"] += 1
    port_key = f"decode:{scope['server'][1]}"
    COUNTS[port_key] = COUNTS.get(port_key, 0) + 1
    conversation = params.get("kvturn_conversation")
    # Its "prefix cache": a conversation it served before (a decode-local turn) is cached.
    cached = _PROMPT_TOKENS - 8 if conversation in _CONVERSATIONS else 0
    if conversation is not None:
        _CONVERSATIONS.add(conversation)
        if len(_CONVERSATIONS) > 10_000:
            _CONVERSATIONS.clear()
    if not params.get("do_remote_prefill"):
        COUNTS["decode_local"] = COUNTS.get("decode_local", 0) + 1
    LAST_CACHE_SALT["decode"] = body.get("cache_salt")
    LAST_HEADERS["decode"] = _recorded(scope)
    LAST_LEASE_ASKED["retain"] = params.get("kvturn_lease_s")
    _RETAINED[request_id] = {
        "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "fake-d",
        "remote_request_id": request_id, "remote_host": "localhost", "remote_port": 2,
        "remote_num_tokens": _PROMPT_TOKENS + 1, "expires_in_s": 300.0,
        PREFIX_DIGESTS_KEY: _HELD_DIGESTS, PROMPT_TOKENS_KEY: _PROMPT_TOKENS,
    }  # fmt: skip
    if len(_RETAINED) > 10_000:
        _RETAINED.pop(next(iter(_RETAINED)))
    tool = (body.get("tool_choice") or {}) if isinstance(body.get("tool_choice"), dict) else {}
    called = (tool.get("function") or {}).get("name")
    if not body.get("stream"):
        answer = _completion(request_id)
        if not params.get("do_remote_prefill"):
            answer["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
        if conversation:  # as the connector's request_finished hands them to vLLM's reply
            answer["kv_transfer_params"] = _RETAINED[request_id]
        if called:  # a named tool choice: the model calls it
            answer["choices"][0]["message"] = {"role": "assistant", "content": None,
                                               "tool_calls": [_tool_call(called)]}  # fmt: skip
            answer["choices"][0]["finish_reason"] = "tool_calls"
        await _send_json(send, 200, answer)
        return
    if body.get("fake_slow_stream"):
        chunks = int(body["fake_slow_stream"])
        await _slow_stream(request_id, chunks, receive, send, body.get("fake_break_after"))
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    deltas: list[tuple[dict[str, Any], str | None]] = [
        ({"content": "o"}, None),
        ({"content": "k"}, "stop"),
    ]
    if called:  # a named tool choice: the call streams in two pieces
        call = _tool_call(called)
        head = {**call, "index": 0, "function": {"name": called, "arguments": ""}}
        tail = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
        deltas = [({"tool_calls": [head]}, None), ({"tool_calls": [tail]}, "tool_calls")]
    for delta, finish in deltas:
        chunk = {"id": request_id, "object": "chat.completion.chunk", "created": 0, "model": "fake",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})  # fmt: skip
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"id": request_id, "object": "chat.completion.chunk", "created": 0, "model": "fake",
                 "choices": [], "usage": _completion(request_id)["usage"]}  # fmt: skip
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\n".encode(),
                    "more_body": True})  # fmt: skip
    if body.get("fake_end_delay_ms"):
        # ``[DONE]`` first, the end of the body a moment later (in another read): a client
        # may close its connection in between.
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await asyncio.sleep(float(body["fake_end_delay_ms"]) / 1000)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _recorded(scope: Scope) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in scope["headers"] if k in _RECORDED_HEADERS}


async def _wait_unless_abandoned(seconds: float, receive: Any) -> bool:
    """Sleep ``seconds``; False, at once, if the client disconnects meanwhile (as vLLM aborts
    a request whose client left)."""
    disconnect = asyncio.ensure_future(receive())
    try:
        await asyncio.wait_for(asyncio.shield(disconnect), seconds)
    except TimeoutError:
        return True
    finally:
        disconnect.cancel()
    return disconnect.result().get("type") != "http.disconnect"


#: The longest lease the fake's "connector" grants (as ``decoder_kv_blocks_ttl``), reported
#: with its lease stats; None: it reports no engine facts (as before a test sets it).
MAX_LEASE_S: float | None = None


async def _lease_route(scope: Scope, path: str, receive: Any, send: Any) -> None:
    """The connector's lease routes, as far as the gateway's unit tests need them: a claim
    takes the lease (a read frees it), a renew extends it, a DELETE frees it."""
    parts = path.strip("/").split("/")
    method = scope["method"]
    if len(parts) == 2:
        stats: dict[str, Any] = {"leases": len(_RETAINED), "blocks_held": 0, "ended": {}}
        if MAX_LEASE_S:  # what a connector says of its engine (see LeaseTable.stats)
            stats.update(kvturn_block_size=128, kvturn_kv_bytes_per_token=4096,
                         kvturn_max_lease_s=MAX_LEASE_S)  # fmt: skip
        await _send_json(send, 200, stats)
        return
    key = parts[2]
    if method == "DELETE":
        released = _RETAINED.pop(key, None) is not None
        COUNTS["releases"] = COUNTS.get("releases", 0) + released
        if b"claimed=1" in scope.get("query_string", b""):  # the gateway's own claim ends
            COUNTS["claims_ended"] = COUNTS.get("claims_ended", 0) + 1
        await _send_json(send, 200, {"released": released})
        return
    found = _RETAINED.get(key)
    if found is None:
        await _send_json(send, 404, {"error": "no live lease", "reason": "unknown"})
    elif parts[-1] == "claim":
        COUNTS["claims"] = COUNTS.get("claims", 0) + 1
        await _send_json(send, 200, _RETAINED.pop(key))
    else:
        lease_s = float(json.loads(await _read(receive) or b"{}").get("lease_s", 0))
        LAST_LEASE_ASKED["renew"] = lease_s
        lease_s = min(lease_s, MAX_LEASE_S or lease_s)  # as a connector cuts it
        found["expires_in_s"] = max(found["expires_in_s"], lease_s)
        await _send_json(send, 200, {"expires_in_s": lease_s})


async def _slow_stream(
    request_id: str, chunks: int, receive: Any, send: Any, break_after: int | None
) -> None:
    """``chunks`` SSE events 20 ms apart; counts the stream as abandoned if the reader leaves.
    With ``break_after``, the engine fails after that many events (the connection drops)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    gone = asyncio.ensure_future(receive())
    try:
        for i in range(chunks):
            if i == break_after:
                raise RuntimeError("fake engine: stream breaks off (fake_break_after)")
            chunk = {"id": request_id, "object": "chat.completion.chunk", "created": 0,
                     "model": "fake", "choices": [{"index": 0, "delta": {"content": f"{i} "},
                                                   "finish_reason": None}]}  # fmt: skip
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(chunk)}\n\n".encode()})  # fmt: skip
            await asyncio.sleep(0.02)
            if gone.done():
                COUNTS["abandoned"] += 1
                return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    finally:
        gone.cancel()
