"""The gateway is transparent: the same request answered by the gateway (prefill + decode) and
by one engine alone (a fresh ``cache_salt``, so nothing cached serves it) must agree field by
field, streamed or not, error or not.

Allowed differences, and why (the whole list):

- ``id``, ``created``, tool-call ids: made per request by whoever answers;
- ``usage.prompt_tokens_details.cached_tokens``: decode counts the KV it pulled as cached;
- ``system_fingerprint``, ``metrics``: per-engine facts;
- log-probabilities within ``LOGPROB_TOLERANCE``: float32 on two engines, one of them
  computing from KV another computed, rounds differently in the last digits;
- how a stream is cut into chunks: the engine merges tokens into one chunk when its reader
  lags, so streams are compared by what they say once reassembled, and by the set of field
  paths their chunks carry (a field dropped anywhere fails);
- a request the gateway refuses at its edge (a field it reads is missing or of the wrong
  shape: ``kvturn/gateway/validation.py``) gets the engine's status with the gateway's own
  OpenAI-shaped error naming the field, not vLLM's text (refused before any engine work, so
  no lease is claimed and no prefill runs for it).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from kvturn.headers import conversation_id_from_header
from tests.conftest import LocalPair
from tests.conversation_ids import ID_FORMS, WAYS, named
from tests.engine_requests import long_prompt

pytestmark = pytest.mark.engines

LOGPROB_TOLERANCE = 1e-4
#: Fields that differ per answer by nature (see the module docstring).
_VOLATILE = frozenset({"id", "created", "system_fingerprint", "metrics", "cached_tokens"})
_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_sensor",
            "description": "Read a sensor by name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": ["temp", "humidity"]}},
                "required": ["name"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open_valve",
            "description": "Open a valve.",
            "parameters": {
                "type": "object",
                "properties": {"percent": {"type": "integer"}},
                "required": ["percent"],
            },
        },
    },
]
_TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read_sensor", "arguments": '{"name": "temp"}'},
}


@dataclass
class Case:
    name: str
    path: str
    body: dict[str, Any]
    method: str = "POST"
    #: Sent with a fresh cache salt to the engine (the generating routes).
    salted: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    #: Refused by the gateway's edge validation: the field its error must name.
    edge: str | None = None


def _edge(case: Case, param: str) -> Case:
    case.edge = param
    return case


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _chat(name: str, stream: bool = False, **body: Any) -> Case:
    body.setdefault("messages", _user("Write about the harbour at dawn."))
    body.setdefault("max_tokens", 12)
    body.setdefault("temperature", 0)
    return Case(name, _CHAT, {"stream": stream, **body})


def _completion(name: str, stream: bool = False, **body: Any) -> Case:
    body.setdefault("prompt", "The lighthouse keeper said")
    body.setdefault("max_tokens", 10)
    body.setdefault("temperature", 0)
    return Case(name, _COMPLETIONS, {"stream": stream, **body})


_USAGE = {"stream_options": {"include_usage": True}}
_SEEDED = {"temperature": 0.9, "seed": 1234}
_PROMPTS_2 = ["The river delta", "A volcano erupts and"]
_PROMPTS_3 = ["Kites fly", "In the glacier cave", "Deep under the sea the"]
_NAMED = {"type": "function", "function": {"name": "read_sensor"}}

CASES = [
    # chat: plain forms
    _chat("chat"),
    _chat("chat-stream", stream=True),
    _chat("chat-stream-usage", stream=True, **_USAGE),
    _chat(
        "chat-system-multi-turn",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a bird."},
            {"role": "assistant", "content": "A heron."},
            {"role": "user", "content": "Another one, and say where it lives."},
        ],
    ),
    _chat(
        "chat-content-parts",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe the tide."},
                    {"type": "text", "text": "Briefly."},
                ],
            }
        ],
    ),
    _chat("chat-long-prompt", messages=_user(long_prompt(1200, "estuaries"))),
    _chat("chat-long-prompt-stream", stream=True, messages=_user(long_prompt(900, "dunes"))),
    # chat: sampling and stopping
    _chat("chat-stop", stop=["e", "a"], max_tokens=30),
    _chat("chat-stop-stream", stream=True, stop=["o"], max_tokens=30),
    _chat("chat-stop-token-ids", stop_token_ids=[101, 102, 103], max_tokens=30),
    _chat("chat-max-completion-tokens", max_completion_tokens=7),
    _chat("chat-max-completion-tokens-stream", stream=True, max_completion_tokens=5, **_USAGE),
    _chat("chat-min-tokens-ignore-eos", min_tokens=15, max_tokens=15, ignore_eos=True),
    _chat("chat-penalties", presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.2),
    _chat("chat-logit-bias", logit_bias={"65": 5, "66": -100}),
    _chat("chat-seeded-sampling", **_SEEDED, top_p=0.9, top_k=40),
    _chat("chat-n2-seeded", n=2, **_SEEDED),
    _chat("chat-n2-seeded-stream", stream=True, n=2, **_SEEDED, **_USAGE),
    _chat("chat-logprobs", logprobs=True, top_logprobs=3),
    _chat("chat-logprobs-stream", stream=True, logprobs=True, top_logprobs=2),
    _chat("chat-return-token-ids", return_token_ids=True),
    # chat: structured output and tools
    _chat("chat-json-object", response_format={"type": "json_object"}, max_tokens=20),
    _chat(
        "chat-json-schema",
        max_tokens=30,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "reading",
                "schema": {
                    "type": "object",
                    "properties": {"level": {"type": "integer"}},
                    "required": ["level"],
                },
            },
        },
    ),
    _chat("chat-tools-named", tools=_TOOLS, tool_choice=_NAMED, max_tokens=40),
    _chat("chat-tools-named-stream", stream=True, tools=_TOOLS, tool_choice=_NAMED, max_tokens=40),
    _chat("chat-tools-required", tools=_TOOLS, tool_choice="required", max_tokens=60),
    _chat("chat-tools-auto", tools=_TOOLS, tool_choice="auto"),
    _chat("chat-tools-auto-stream", stream=True, tools=_TOOLS, tool_choice="auto"),
    _chat(
        "chat-tools-no-parallel",
        tools=_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    ),
    _chat(
        "chat-tool-round-trip",
        tools=_TOOLS,
        messages=[
            *_user("What is the temperature?"),
            {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        ],
    ),
    # chat: what the engine refuses
    _chat("chat-error-n2-greedy", n=2),
    _chat("chat-error-n2-greedy-stream", stream=True, n=2),
    _chat("chat-error-context-too-long", messages=_user(long_prompt(21000, "walls"))),
    _chat("chat-error-max-tokens", max_tokens=10**7),
    _chat("chat-error-temperature", temperature=-1),
    _chat(
        "chat-error-unknown-tool",
        tools=_TOOLS,
        tool_choice={"type": "function", "function": {"name": "nope"}},
    ),
    _chat("chat-error-unknown-model", model="no-such-model"),
    _edge(_chat("chat-error-empty-messages", messages=[]), "messages"),
    _edge(_chat("chat-error-no-messages", messages=None), "messages"),
    _edge(_chat("chat-error-messages-not-objects", messages=[1, 2]), "messages"),
    _edge(_chat("chat-error-tools-not-a-list", tools="x"), "tools"),
    _edge(_chat("chat-error-negative-max-tokens", max_tokens=-1), "max_tokens"),
    # completions
    _completion("completion"),
    _completion("completion-stream", stream=True),
    _completion("completion-stream-usage", stream=True, **_USAGE),
    _completion("completion-token-ids", prompt=[72, 101, 108, 108, 111, 32, 116, 104]),
    _completion("completion-one-element-list", prompt=["The orchard in spring"]),
    _completion("completion-echo", echo=True),
    _completion("completion-logprobs", logprobs=2),
    _completion("completion-logprobs-stream", stream=True, logprobs=2),
    _completion("completion-stop", stop=["e"], max_tokens=30),
    _completion("completion-seeded", **_SEEDED),
    # completions: batches (one engine answers every prompt with its own KV)
    _completion("completion-batch2", prompt=_PROMPTS_2),
    _completion("completion-batch2-stream", stream=True, prompt=_PROMPTS_2),
    _completion("completion-batch3", prompt=_PROMPTS_3, max_tokens=14),
    _completion("completion-batch3-stream-usage", stream=True, prompt=_PROMPTS_3, **_USAGE),
    _completion("completion-batch2-token-ids", prompt=[[72, 101, 108], [84, 104, 101, 32]]),
    _completion("completion-batch2-n2-seeded", prompt=_PROMPTS_2, n=2, **_SEEDED),
    _completion(
        "completion-batch2-n2-seeded-stream",
        stream=True,
        prompt=_PROMPTS_2,
        n=2,
        **_SEEDED,
        **_USAGE,
    ),
    _completion("completion-batch2-logprobs", prompt=_PROMPTS_2, logprobs=1),
    _completion("completion-batch3-echo-stream", stream=True, prompt=_PROMPTS_3, echo=True),
    _completion("completion-error-batch-too-long", prompt=["short", long_prompt(21000)]),
    _completion("completion-error-n2-greedy", n=2),
    _edge(_completion("completion-error-no-prompt", prompt=None), "prompt"),
    # vLLM's utility routes
    Case("models", "/v1/models", {}, method="GET", salted=False),
    Case("version", "/version", {}, method="GET", salted=False),
    Case("tokenize-prompt", "/tokenize", {"prompt": "Hello there"}, salted=False),
    Case("tokenize-chat", "/tokenize", {"messages": _user("Hi")}, salted=False),
    Case("detokenize", "/detokenize", {"tokens": [72, 101, 108, 108, 111]}, salted=False),
    Case("tokenize-error", "/tokenize", {"nonsense": True}, salted=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gateway_answers_as_one_engine_alone(local_pair: LocalPair, case: Case) -> None:
    body = {k: v for k, v in case.body.items() if v is not None}
    if case.path in (_CHAT, _COMPLETIONS):
        body.setdefault("model", local_pair.model)
    gateway_base = local_pair.gateway_url.removesuffix("/v1")
    via_gateway = _send(gateway_base, case, body)
    engine_body = {**body, "cache_salt": uuid.uuid4().hex} if case.salted else body
    alone = _send(local_pair.prefill_url, case, engine_body)

    assert via_gateway.status_code == alone.status_code, (via_gateway.text, alone.text)
    assert _media_type(via_gateway) == _media_type(alone)
    if case.edge is not None:
        error = orjson.loads(via_gateway.content)["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == case.edge, error
        assert "error" in orjson.loads(alone.content)
        return
    if _media_type(alone).startswith("text/event-stream"):
        _assert_same_stream(via_gateway.text, alone.text)
    elif _media_type(alone).startswith("application/json"):
        _assert_same(orjson.loads(via_gateway.content), orjson.loads(alone.content), "$")
    else:
        assert via_gateway.content == alone.content


def test_any_conversation_id_is_served_with_reuse(local_pair: LocalPair) -> None:
    """Issue 40: every form of id (``tests/conversation_ids.py``: spaces, ``/?#%``, non-ASCII,
    over 128 characters, 1,024 bytes of UTF-8, …), named by ``prompt_cache_key``,
    ``X-Session-ID`` or ``X-Conversation-Id``, is answered 200 through the gateway, echoed,
    and its second turn reuses the first's KV."""
    url = local_pair.gateway_url + "/chat/completions"
    for way in WAYS:
        for name, conversation_id in ID_FORMS.items():
            headers, extra = named(way, conversation_id)
            topic = f"{way} {name} {uuid.uuid4().hex}"
            messages = _user(long_prompt(400, topic))
            body = {"model": local_pair.model, "max_tokens": 4, "temperature": 0, **extra}
            first = httpx.post(url, json={**body, "messages": messages}, headers=headers,
                               timeout=300)  # fmt: skip
            assert first.status_code == 200, (way, name, first.text)
            echoed = first.headers["x-conversation-id"]
            assert conversation_id_from_header(echoed) == conversation_id, (way, name)
            reply = first.json()["choices"][0]["message"]["content"] or ""
            messages += [{"role": "assistant", "content": reply}, *_user("And then?")]
            second = httpx.post(url, json={**body, "messages": messages}, headers=headers,
                                timeout=300)  # fmt: skip
            assert second.status_code == 200, (way, name, second.text)
            plan = (second.headers["x-kvturn-plan"], second.headers["x-kvturn-plan-reason"])
            assert plan[0] != "recompute", (way, name, plan)


def test_differential_suite_covers_enough_shapes() -> None:
    generating = [c for c in CASES if c.path in (_CHAT, _COMPLETIONS)]
    batches = [c for c in generating if isinstance(c.body.get("prompt"), list)
               and len(c.body["prompt"]) > 1]  # fmt: skip
    assert len(CASES) >= 40
    assert {len(c.body["prompt"]) for c in batches} >= {2, 3}
    assert {c.body["stream"] for c in batches} == {True, False}


def _send(base: str, case: Case, body: dict[str, Any]) -> httpx.Response:
    url = base + case.path
    if case.method == "GET":
        return httpx.get(url, timeout=300)
    return httpx.post(url, content=orjson.dumps(body), timeout=300,
                      headers={"Content-Type": "application/json"})  # fmt: skip


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "")


def _assert_same(got: Any, want: Any, path: str) -> None:
    """Equal, field by field, but for the allowed differences."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not an object"
        assert got.keys() == want.keys(), f"{path}: fields {sorted(got)} != {sorted(want)}"
        for key, value in want.items():
            if key in _VOLATILE or (key == "id" and path.endswith("tool_calls[]")):
                continue
            _assert_same(got[key], value, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b, f"{path}[]")
    elif isinstance(want, float) and isinstance(got, float) and "logprob" in path:
        assert math.isclose(got, want, abs_tol=LOGPROB_TOLERANCE), f"{path}: {got} != {want}"
    elif isinstance(want, str) and path.endswith("error.message"):
        # Engines name the request in some messages (its id): compare the rest.
        assert _without_ids(got) == _without_ids(want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _without_ids(message: str) -> str:
    return " ".join(w for w in message.split() if not any(c.isdigit() for c in w[-8:]))


def _events(text: str) -> list[Any]:
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), f"not a data event: {block[:80]!r}"
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def _assert_same_stream(got_text: str, want_text: str) -> None:
    got, want = _events(got_text), _events(want_text)
    assert (got[-1] == "[DONE]") == (want[-1] == "[DONE]")
    assert got.count("[DONE]") == want.count("[DONE]") <= 1
    got_data = [e for e in got if e != "[DONE]"]
    want_data = [e for e in want if e != "[DONE]"]
    assert _paths(got_data) == _paths(want_data), "the chunks carry different fields"
    _assert_same(_reassembled(got_data), _reassembled(want_data), "stream")


def _paths(events: list[Any], prefix: str = "") -> set[str]:
    """Every field path the events carry (list positions folded)."""
    paths: set[str] = set()
    for event in events:
        if isinstance(event, dict):
            for key, value in event.items():
                paths.add(f"{prefix}.{key}")
                paths |= _paths([value], f"{prefix}.{key}")
        elif isinstance(event, list):
            paths |= _paths(event, prefix + "[]")
    return paths


def _reassembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a stream says once its chunks are put together, per choice index."""
    choices: dict[int, dict[str, Any]] = {}
    usage = [e["usage"] for e in events if not e.get("choices") and e.get("usage")]
    errors = [e["error"] for e in events if "error" in e]
    for event in events:
        for choice in event.get("choices") or []:
            into = choices.setdefault(choice["index"], {"text": "", "logprobs": [], "tools": {}})
            delta = choice.get("delta") or {}
            into["text"] += choice.get("text") or delta.get("content") or ""
            if delta.get("role"):
                into["role"] = delta["role"]
            for name in ("finish_reason", "stop_reason", "token_ids", "prompt_token_ids"):
                if choice.get(name) is not None:
                    into.setdefault(name, [])
                    into[name].append(choice[name])
            logprobs = choice.get("logprobs") or {}
            into["logprobs"] += logprobs.get("content") or []
            tokens = zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
                         strict=True)  # fmt: skip
            into["logprobs"] += [[token, logprob] for token, logprob in tokens]
            for call in delta.get("tool_calls") or []:
                tool = into["tools"].setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                tool["name"] += function.get("name") or ""
                tool["arguments"] += function.get("arguments") or ""
    return {"choices": choices, "usage": usage, "errors": errors}


def test_a_keyed_gateway_guards_what_a_keyed_engine_guards(local_pair: LocalPair) -> None:
    """With an API key, the gateway answers each route with the status a vLLM engine started
    with ``--api-key`` gives it: ``/metrics``, ``/tokenize``, ``/detokenize``, ``/version``
    and ``/health`` open; ``/v1/...`` 401 without the key. The keyed engine is the test pair's
    prefill behind vLLM's own ``AuthenticationMiddleware``, loaded from the installed wheel
    (``vllm/entrypoints/serve/middleware/authenticate.py``), which is all ``--api-key`` adds
    to vLLM's API server (``serve/middleware/register.py``): starting a third engine with the
    flag would cost minutes of this machine's cores for the same middleware. Statuses only: a
    401's body is OpenAI's shape (what the SDKs read), where vLLM's is ``{"error":
    "Unauthorized"}``."""
    import asyncio

    from kvturn.gateway.auth import ApiKeys
    from kvturn.gateway.config import GatewayConfig, endpoints
    from tests.gateway_fixtures import running_gateway, vllm_auth_middleware

    key = "sk-differential-0123456789abcdef"
    engine = local_pair.prefill_url

    async def forward(scope: Any, receive: Any, send: Any) -> None:
        """The engine itself, behind the middleware (an HTTP relay)."""
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with httpx.AsyncClient(timeout=300) as client:
            answer = await client.request(
                scope["method"], engine + scope["path"], content=body,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
        await send({"type": "http.response.start", "status": answer.status_code, "headers": []})
        await send({"type": "http.response.body", "body": answer.content})

    keyed_engine = vllm_auth_middleware()(forward, tokens=[key])

    async def engine_status(method: str, path: str, body: Any, headers: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=keyed_engine)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            answer = await client.request(method, path, json=body, headers=headers)
            return answer.status_code

    calls: list[tuple[str, str, Any]] = [
        ("GET", "/metrics", None),
        ("POST", "/tokenize", {"prompt": "Hello there"}),
        ("POST", "/detokenize", {"tokens": [72, 101]}),
        ("GET", "/version", None),
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", _CHAT, {"model": local_pair.model, "messages": _user("Hi"), "max_tokens": 1}),
    ]
    config = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        control_secret=local_pair.control_secret,
        api_keys=ApiKeys([(key, "differential")]),
    )
    with running_gateway(config) as gateway:
        for auth in (None, f"Bearer {key}", "Bearer sk-wrong-0123456789abcdef"):
            headers = {"Authorization": auth} if auth else {}
            for method, path, body in calls:
                got = httpx.request(
                    method, gateway.url + path, json=body, headers=headers, timeout=300
                ).status_code
                want = asyncio.run(engine_status(method, path, body, headers))
                assert got == want, (auth, method, path)
                if path in ("/metrics", "/tokenize"):
                    assert got == 200, (auth, path)


# ---- what a client moving from vLLM (or vllm-router) relies on beyond the bodies -------------


def test_the_callers_request_id_is_echoed_and_reaches_the_engines(local_pair: LocalPair) -> None:
    body = {"model": local_pair.model, "messages": _user("Hi"), "max_tokens": 4}
    for stream in (False, True):
        response = httpx.post(
            local_pair.gateway_url + "/chat/completions",
            json={**body, "stream": stream},
            headers={"X-Request-Id": "diff-req-7"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "diff-req-7"
        # vLLM names a chat reply after the request id it was sent: the engine saw the
        # caller's id (then the gateway's 128 random bits).
        if stream:
            first = next(e for e in response.text.split("\n\n") if e.startswith("data: {"))
            reply_id = orjson.loads(first.removeprefix("data: "))["id"]
        else:
            reply_id = response.json()["id"]
        assert reply_id.startswith("chatcmpl-diff-req-7-kvturn-"), reply_id


def test_a_stream_longer_than_the_request_timeout_completes(local_pair: LocalPair) -> None:
    from kvturn.gateway.config import GatewayConfig, endpoints
    from tests.gateway_fixtures import running_gateway

    body = {
        "model": local_pair.model,
        "messages": _user("Count on and on."),
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # An idle decode's worker parks on its socket (kvturn caps its spin window while idle:
    # kvturn.connector.engine_pacing), and a wake-up vLLM loses there costs 5 s (its
    # SHM_READER_RECHECK_INTERVAL_MS). Generating, the worker spins as upstream's does; one
    # stream first makes this one start on an engine that just generated, not on an idle one:
    # the timeout of silences is this test's subject, not that hand-over.
    started = time.monotonic()
    warm = httpx.post(local_pair.gateway_url + "/chat/completions", json=body, timeout=300)
    assert warm.status_code == 200
    # 1,500 tokens stream for 5 to 10 s on the tiny model, depending on the machine; no gap
    # between chunks comes near a quarter of that. The timeout follows the machine's pace, so
    # that the stream outlives it whether the machine is fast or slow.
    config = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        control_secret=local_pair.control_secret,
        request_timeout_s=(time.monotonic() - started) / 4,
    )
    with running_gateway(config) as gateway:
        started = time.monotonic()
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300)
        elapsed = time.monotonic() - started
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    usage = orjson.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 1500
    # The stream outlived the timeout many times over: it bounds each wait, not the reply.
    assert elapsed > 2 * config.request_timeout_s, elapsed
