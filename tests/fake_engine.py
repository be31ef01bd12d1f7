"""A fast stand-in for a vLLM engine speaking the P/D protocol: for narrow gateway tests and
the gateway-overhead benchmark only. It never proves reuse works on a real engine (the engine
tests do that); it only never claims reuse it does not hold.

One raw ASGI app plays both roles: with ``do_remote_decode`` in the request it answers like a
prefill (``kv_transfer_params`` for decode); otherwise like a decode (a short reply, streamed or
not) and publishes "retained KV" on ``/kvturn/retained/{id}`` like the kvturn connector (a
non-streamed reply of a conversation's turn carries the same as its ``kv_transfer_params``, as
vLLM hands back what the connector's ``request_finished`` returns).
``/metrics`` answers like one vLLM engine (vllm-router reads it at start-up to count DP ranks),
with its prefix cache's counters; ``/fake/counts`` says how many prefill and decode requests it
served (to check a router's P/D routing), and how many slow streams (``fake_slow_stream``: one
chunk per 20 ms) their reader abandoned; any other GET is a 404. ``in_flight`` and
``peak_in_flight`` count the ``/v1`` POSTs (engine requests) being served at once, now and at
most (a test resets the peak).

**Tokens, as an engine has them.** Every prompt is tokenized as a real engine would, in shape:
a chat is rendered by a ChatML template (the one ``kvturn``'s own models use:
``<|im_start|>role\\ncontent<|im_end|>\\n``, tools in a system block, tool calls in
``<tool_call>``, the generation prompt), and text becomes one token per UTF-8 byte (ids 0-255;
the template's markers are :data:`SPECIAL_TOKENS`, 256 on, as the tiny model's byte-level
tokenizer numbers them). ``/tokenize`` answers for every chat and completion prompt. The one
template option it knows besides vLLM's own fields: ``chat_template_kwargs={"pad_messages": N}``
pads every message with N spaces (a template that renders a message to more tokens than its
bytes, which the gateway's bound on a turn's new tokens does not expect of a real one).

**Its prefix cache, and what it says it reused.** Each port is two engines, a decode and a
prefill, each with a prefix cache of whole :data:`BLOCK_SIZE`-token blocks keyed by the chain of
their token ids and the request's ``cache_salt`` (as vLLM hashes blocks). A decode request looks
its prompt up (whole blocks, never the prompt's last token, as vLLM computes that one always),
says what it found as ``usage.prompt_tokens_details.cached_tokens`` and on ``/metrics``
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``), then caches the blocks
of what it computed (its prompt and reply). It retains that (prompt and reply, less the reply's
last token, whose KV is never computed) for a conversation's next turn and publishes it with
the chained digests of those exact token ids. A prefill that is handed such a lease to pull
reads only the common prefix of the tokens the holder still holds (a lease is read once, and
gone once released) and its prompt, as far as the digests verify it, never its last token: its
``cached_tokens`` are what it read, plus its own prefix cache's hits where
:data:`PREFILL_PREFIX_CACHING` is on (off by default, as ``kvturn up`` starts prefill engines).
:func:`clear_prefix_cache` empties a port's caches (an engine that recomputes everything).
Nothing here depends on what a prompt says.

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
import re
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs

from kvturn.wire import (
    DIGEST_CHUNK_TOKENS,
    PREFILL_CACHED_KEY,
    PREFIX_DIGESTS_KEY,
    PROMPT_TOKENS_KEY,
    common_prefix_tokens,
    prefix_digests,
)

Scope = dict[str, Any]

_RETAINED: dict[str, dict[str, Any]] = {}
_THROTTLED: set[str] = set()
COUNTS = {"prefill": 0, "decode": 0, "abandoned": 0, "in_flight": 0, "peak_in_flight": 0}
#: When set, /v1 POSTs need ``Authorization: Bearer <this>`` (as vLLM's ``--api-key``).
REQUIRED_KEY: str | None = None
#: The ``cache_salt`` of the last prefill and the last decode request (tenant isolation tests).
LAST_CACHE_SALT: dict[str, str | None] = {"prefill": None, "decode": None}
#: The scheduling priority of every prefill request, in order (vLLM's default 0 where unset).
PREFILL_PRIORITIES: list[int] = []
#: The request id and trace headers of the last prefill and the last decode request.
LAST_HEADERS: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
#: The lease the gateway last asked for: with a decode request (``retain``) and a renewal.
LAST_LEASE_ASKED: dict[str, float | None] = {"retain": None, "renew": None}
_RECORDED_HEADERS = (b"x-request-id", b"traceparent", b"tracestate")
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
#: Whether prefill engines keep a prefix cache of their own (``kvturn up`` starts them without).
PREFILL_PREFIX_CACHING = False
#: Whether prefill says which of its cached tokens its own prefix cache served (the connector's
#: ``kvturn_prefill_cached_tokens``); off: it says nothing, as an older engine.
PREFILL_REPORTS_OWN_CACHED = False
#: Push mode: X-Request-Id -> whether its prefill's KV was written to decode.
_PUSHED: dict[str, bool] = {}
#: Push mode: X-Request-Id -> "awaiting" or "arrived", as a push decode says.
_PUSH_STATE: dict[str, str] = {}
_GAUGES = "".join(
    f'# TYPE vllm:{name} gauge\nvllm:{name}{{engine="0",model_name="fake"}} 0.0\n'
    for name in ("num_requests_running", "num_requests_waiting")
)

# ---- tokens -------------------------------------------------------------------------------------

#: The chat template's markers, in id order after the 256 byte tokens (as the tiny model's).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_SPECIAL_IDS = {text: 256 + i for i, text in enumerate(SPECIAL_TOKENS)}
_TOOLS_PREAMBLE = (
    'You can call these tools. To call one, answer <tool_call>{"name": NAME, "arguments": '
    "ARGS}</tool_call>.\n<tools>\n"
)
#: What every decode answers: its text, and its token ids.
REPLY_TEXT = "ok"


_MARKERS = re.compile("(" + "|".join(re.escape(m) for m in SPECIAL_TOKENS) + ")")


def token_ids(text: str) -> list[int]:
    """``text`` as the fake's tokenizer has it: a marker is one token, every other UTF-8 byte
    one token."""
    ids: list[int] = []
    for i, piece in enumerate(_MARKERS.split(text)):
        if i % 2:
            ids.append(_SPECIAL_IDS[piece])
        else:
            ids.extend(piece.encode())
    return ids


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text") or "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def render_chat(request: dict[str, Any]) -> str:
    """A chat request's prompt text, by the ChatML template with tools (the shape of
    ``kvturn/gateway/ops/launch/templates/chatml_tools.jinja``)."""
    messages = request.get("messages")
    messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    tools = request.get("tools") if isinstance(request.get("tools"), list) else []
    kwargs = request.get("chat_template_kwargs")
    pad = kwargs.get("pad_messages") if isinstance(kwargs, dict) else None
    padding = " " * pad if type(pad) is int and pad > 0 else ""
    parts: list[str] = []
    skip_first = bool(tools) and bool(messages) and messages[0].get("role") == "system"
    if tools:
        parts.append("<|im_start|>system\n")
        if skip_first:
            parts.append(_content_text(messages[0].get("content")) + "\n\n")
        parts.append(_TOOLS_PREAMBLE)
        for tool in tools:
            described = tool.get("function", tool) if isinstance(tool, dict) else tool
            parts.append(json.dumps(described) + "\n")
        parts.append("</tools><|im_end|>\n")
    continue_final = bool(request.get("continue_final_message"))
    for i, message in enumerate(messages):
        if skip_first and i == 0:
            continue
        parts.append(f"<|im_start|>{message.get('role')}\n{padding}")
        parts.append(_content_text(message.get("content")))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            parts.append(
                f'<tool_call>{{"name": "{function.get("name")}", "arguments": {arguments}}}'
                "</tool_call>"
            )
        if not (continue_final and i == len(messages) - 1):
            parts.append("<|im_end|>\n")
    if request.get("add_generation_prompt", True) and not continue_final:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def prompt_ids(request: dict[str, Any]) -> list[int]:
    """The token ids of a chat request's or a completion request's prompt."""
    if "messages" in request:
        return token_ids(render_chat(request))
    prompt = request.get("prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):  # several prompts: the first (the gateway sends one each)
        prompt = prompt[0] if prompt else ""
    return token_ids(str(prompt or ""))


# ---- the prefix caches --------------------------------------------------------------------------

#: Tokens in one KV block: a prefix cache serves whole blocks only.
BLOCK_SIZE = 16
#: Blocks one engine's prefix cache keeps (least recently used beyond that are evicted).
CACHE_BLOCKS = 200_000


class PrefixCache:
    """One engine's prefix cache: whole blocks, each keyed by the chain of every token id up
    to its end and the request's cache salt (no two salts share a block)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, served from the cache

    @staticmethod
    def _keys(ids: list[int], salt: str | None) -> list[int]:
        keys, previous = [], hash(("salt", salt))
        for start in range(0, len(ids) - len(ids) % BLOCK_SIZE, BLOCK_SIZE):
            previous = hash((previous, tuple(ids[start : start + BLOCK_SIZE])))
            keys.append(previous)
        return keys

    def lookup(self, prompt: list[int], salt: str | None) -> int:
        """The prompt's leading tokens this cache holds, in whole blocks, never its last
        token (the engine computes that one always); counted on the metrics."""
        found = 0
        for key in self._keys(prompt, salt)[: max(0, len(prompt) - 1) // BLOCK_SIZE]:
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            found += BLOCK_SIZE
        self.queries += len(prompt)
        self.hits += found
        return found

    def store(self, ids: list[int], salt: str | None) -> None:
        """Cache the whole blocks of ``ids`` (tokens whose KV was computed or read)."""
        for key in self._keys(ids, salt):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > CACHE_BLOCKS:
            self.blocks.popitem(last=False)


#: (port, "prefill" or "decode") -> that engine's prefix cache.
_CACHES: dict[tuple[int, str], PrefixCache] = {}
#: X-Request-Id of a decode turn -> the token ids its retained blocks hold (until a prefill
#: reads them or the lease is released).
_HELD: dict[str, list[int]] = {}


def prefix_cache(port: int, role: str) -> PrefixCache:
    cache = _CACHES.get((port, role))
    if cache is None:
        cache = _CACHES[(port, role)] = PrefixCache()
    return cache


def clear_prefix_cache(port: int | None = None) -> None:
    """Empty the prefix caches of ``port``'s engines (every port's if None): what they held
    must be computed again. Retained leases are not touched."""
    for (where, _), cache in _CACHES.items():
        if port is None or where == port:
            cache.blocks.clear()


def _metrics(port: int) -> bytes:
    queries = hits = 0
    for (where, _), cache in _CACHES.items():
        if where == port:
            queries, hits = queries + cache.queries, hits + cache.hits
    counters = "".join(
        f'# TYPE vllm:{name} counter\nvllm:{name}_total{{engine="0",model_name="fake"}} '
        f"{float(value)}\n"
        for name, value in (("prefix_cache_queries", queries), ("prefix_cache_hits", hits))
    )
    return (_GAUGES + counters).encode()


def _pulled(params: dict[str, Any], prompt: list[int]) -> int:
    """What a prefill reads of a lease it was handed: the tokens the holder still holds that
    its prompt starts with, as far as the lease's digests verify them (as kvturn's connector
    trims a pull), never the prompt's last token. The lease is read once."""
    if params.get("remote_block_ids") is None:
        return 0
    key = str(params.get("remote_request_id"))
    held = _HELD.get(key)
    digests = params.get(PREFIX_DIGESTS_KEY)
    if held is None or not isinstance(digests, list):
        return 0  # gone, or no proof of what it holds: nothing is read
    verified = common_prefix_tokens(digests, prompt, DIGEST_CHUNK_TOKENS)
    really = common_prefix_tokens(prefix_digests(held), prompt, DIGEST_CHUNK_TOKENS)
    limit = int(params.get("remote_num_tokens") or 0)
    read = max(0, min(verified, really, limit, len(held), len(prompt) - 1))
    if read:
        del _HELD[key]  # read: the holder frees the blocks
    return read


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


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _completion(request_id: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY_TEXT},
                     "finish_reason": "stop"}],
        "usage": usage,
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
        data = _metrics(scope["server"][1])
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
        COUNTS["tokenize"] = COUNTS.get("tokenize", 0) + 1
        where = f"tokenize:{scope['server'][1]}"  # which engine (port) was asked
        COUNTS[where] = COUNTS.get(where, 0) + 1
        tokens = prompt_ids(request)
        await _send_json(
            send, 200, {"count": len(tokens), "max_model_len": 32768, "tokens": tokens}
        )
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
    port = scope["server"][1]
    salt = body.get("cache_salt")
    prompt = prompt_ids(body)
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
        PREFILL_PRIORITIES.append(int(body.get("priority", 0)))
        LAST_HEADERS["prefill"] = _recorded(scope)
        own = 0
        if PREFILL_PREFIX_CACHING:
            own = prefix_cache(port, "prefill").lookup(prompt, salt)
        # vLLM pulls only what its own cache lacks.
        pulled = max(0, _pulled(params, prompt) - own)
        if pulled:
            COUNTS["pulled_tokens"] = COUNTS.get("pulled_tokens", 0) + pulled
        if PREFILL_PREFIX_CACHING:
            prefix_cache(port, "prefill").store(prompt, salt)
        answer = _completion("prefill", _usage(len(prompt), 1, own + pulled))
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "fake-p", "remote_request_id": "p", "remote_host": "localhost",
            "remote_port": 1, "remote_num_tokens": len(prompt), "tp_size": 1,
        }  # fmt: skip
        if PREFILL_REPORTS_OWN_CACHED:  # as kvturn's connector reports them
            answer["kv_transfer_params"][PREFILL_CACHED_KEY] = own
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
    port_key = f"decode:{port}"
    COUNTS[port_key] = COUNTS.get(port_key, 0) + 1
    conversation = params.get("kvturn_conversation")
    if not params.get("do_remote_prefill"):
        COUNTS["decode_local"] = COUNTS.get("decode_local", 0) + 1
    tool = (body.get("tool_choice") or {}) if isinstance(body.get("tool_choice"), dict) else {}
    called = (tool.get("function") or {}).get("name")
    reply = token_ids(_reply_text(called))
    # Its prefix cache serves what it holds of the prompt (in P/D, it reads only the rest);
    # then it holds the blocks of what it computed: the prompt, and the reply but its last
    # token (whose KV is never computed).
    cache = prefix_cache(port, "decode")
    cached = cache.lookup(prompt, salt)
    held = prompt + reply[:-1]
    cache.store(held, salt)
    usage = _usage(len(prompt), len(reply), cached)
    LAST_CACHE_SALT["decode"] = salt
    LAST_HEADERS["decode"] = _recorded(scope)
    LAST_LEASE_ASKED["retain"] = params.get("kvturn_lease_s")
    _RETAINED[request_id] = {
        "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "fake-d",
        "remote_request_id": request_id, "remote_host": "localhost", "remote_port": 2,
        "remote_num_tokens": len(held), "expires_in_s": 300.0,
        PREFIX_DIGESTS_KEY: prefix_digests(held), PROMPT_TOKENS_KEY: len(prompt),
    }  # fmt: skip
    _HELD[request_id] = held
    if len(_RETAINED) > 10_000:
        _RETAINED.pop(next(iter(_RETAINED)))
    while len(_HELD) > 10_000:
        _HELD.pop(next(iter(_HELD)))
    if not body.get("stream"):
        answer = _completion(request_id, usage)
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
        last = {"id": request_id, "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [], "usage": usage}  # fmt: skip
        await send({"type": "http.response.body", "body": f"data: {json.dumps(last)}\n\n".encode(),
                    "more_body": True})  # fmt: skip
    if body.get("fake_end_delay_ms"):
        # ``[DONE]`` first, the end of the body a moment later (in another read): a client
        # may close its connection in between.
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await asyncio.sleep(float(body["fake_end_delay_ms"]) / 1000)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _reply_text(called: str | None) -> str:
    """What a decode generates: the reply, or the named tool's call as the template renders it."""
    if called is None:
        return REPLY_TEXT
    arguments = _tool_call(called)["function"]["arguments"]
    return f'<tool_call>{{"name": "{called}", "arguments": {arguments}}}</tool_call>'


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
#: How long the fake's "connector" takes to answer a release (a busy engine's control server).
RELEASE_DELAY_S = 0.0


async def _lease_route(scope: Scope, path: str, receive: Any, send: Any) -> None:
    """The connector's lease routes, as far as the gateway's unit tests need them: a claim
    takes the lease (a read frees it), a renew extends it, a DELETE frees it."""
    parts = path.strip("/").split("/")
    method = scope["method"]
    if len(parts) == 2:
        stats: dict[str, Any] = {"leases": len(_RETAINED), "blocks_held": 0, "ended": {}}
        if MAX_LEASE_S:  # what a connector says of its engine (see LeaseTable.stats)
            stats.update(kvturn_block_size=BLOCK_SIZE, kvturn_kv_bytes_per_token=4096,
                         kvturn_max_lease_s=MAX_LEASE_S)  # fmt: skip
        await _send_json(send, 200, stats)
        return
    key = parts[2]
    if method == "DELETE":
        if RELEASE_DELAY_S:
            await asyncio.sleep(RELEASE_DELAY_S)
        released = _RETAINED.pop(key, None) is not None
        _HELD.pop(key, None)  # its blocks are freed
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
