"""A stand-in for the kvturn gateway: an OpenAI-compatible chat server with the control API.

It records what the client sends, answers chat completions (streamed and not, tool calls
included), emulates the gateway's reuse headers with the plans the real gateway produces (a
known, unexpired conversation is served ``pull-reuse`` with the previous turn's tokens reused,
anything else ``recompute``), and implements the heartbeat and
release endpoints of ``kvturn.control``. Request headers steer failure injection:

``X-Stub-Fail-First: 500|429``  fail the first attempt of a request (``x-stainless-retry-count: 0``)
``X-Stub-Delay-Ms: N``          wait before answering
``X-Stub-Chunk-Delay-Ms: N``    wait between streamed chunks

With ``control_api=False`` it is a plain OpenAI-compatible server: no control endpoints, no
kvturn response headers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvturn import headers as h
from kvturn.control import CONVERSATIONS_PATH, HeartbeatResponse, ReleaseResponse

MODEL = "kvturn-stub"


@dataclass
class Recorded:
    """One request as the stand-in saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float


@dataclass
class Beat:
    conversation_id: str
    body: dict[str, Any]
    at: float


@dataclass
class StubGateway:
    """The stand-in's state; tests read it directly (the server runs in-process)."""

    control_api: bool = True
    lease_seconds: float = 30.0
    requests: list[Recorded] = field(default_factory=list)
    heartbeats: list[Beat] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    #: conversation id -> (tokens held, expiry on time.monotonic())
    held: dict[str, tuple[int, float]] = field(default_factory=dict)
    url: str = ""

    def reset(self, *, lease_seconds: float = 30.0) -> None:
        self.lease_seconds = lease_seconds
        self.requests.clear()
        self.heartbeats.clear()
        self.releases.clear()
        self.held.clear()

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    # -- app --------------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ]
        if self.control_api:
            routes += [
                Route(
                    f"/v1{CONVERSATIONS_PATH}/{{cid}}/heartbeat",
                    self._heartbeat,
                    methods=["POST"],
                ),
                Route(f"/v1{CONVERSATIONS_PATH}/{{cid}}", self._release, methods=["DELETE"]),
            ]
        # Last: record whatever no route serves (a plain server's 404s are part of the story).
        routes.append(
            Route("/{path:path}", self._not_found, methods=["GET", "POST", "PUT", "DELETE"])
        )
        return Starlette(routes=routes)

    async def _not_found(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def _record(self, request: Request) -> Recorded:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        rec = Recorded(
            request.method,
            request.url.path,
            {k.lower(): v for k, v in request.headers.items()},
            body,
            time.monotonic(),
        )
        self.requests.append(rec)
        return rec

    async def _models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _heartbeat(self, request: Request) -> Response:
        rec = await self._record(request)
        cid = request.path_params["cid"]
        self.heartbeats.append(Beat(cid, rec.body or {}, rec.at))
        held = self.held.get(cid)
        known = held is not None and held[1] > time.monotonic()
        if known and held is not None:
            self.held[cid] = (held[0], time.monotonic() + self.lease_seconds)
        answer = HeartbeatResponse(
            conversation_id=cid, known=known, lease_remaining_s=self.lease_seconds if known else 0
        )
        return JSONResponse(answer.model_dump())

    async def _release(self, request: Request) -> Response:
        await self._record(request)
        cid = request.path_params["cid"]
        self.releases.append(cid)
        released = self.held.pop(cid, None) is not None
        return JSONResponse(ReleaseResponse(conversation_id=cid, released=released).model_dump())

    async def _chat(self, request: Request) -> Response:
        rec = await self._record(request)
        hdrs = rec.headers
        fail = hdrs.get("x-stub-fail-first")
        if fail and hdrs.get("x-stainless-retry-count", "0") == "0":
            return JSONResponse(
                {"error": {"message": "injected failure", "type": "stub", "code": fail}},
                status_code=int(fail),
                headers={"retry-after-ms": "1"},
            )
        delay = int(hdrs.get("x-stub-delay-ms", "0"))
        if delay:
            await asyncio.sleep(delay / 1000)
        body = rec.body or {}
        messages = body.get("messages", [])
        tool_call, finish = _decide_tool_call(body)
        prompt_tokens = max(1, len(json.dumps(messages)) // 4)
        content = None if tool_call else f"ok after {len(messages)} messages"

        extra_headers: dict[str, str] = {}
        cid = hdrs.get(h.CONVERSATION_ID.lower())
        if cid and self.control_api:
            held = self.held.get(cid)
            now = time.monotonic()
            if held is not None and held[1] > now:
                plan, reused = "pull-reuse", min(held[0], prompt_tokens)
            else:
                plan, reused = "recompute", 0
            self.held[cid] = (prompt_tokens + 8, now + self.lease_seconds)
            extra_headers = {
                h.LEASE_SECONDS: str(self.lease_seconds),
                h.PLAN: plan,
                h.REUSED_TOKENS: str(reused),
            }
        completion_id = "chatcmpl-" + uuid.uuid4().hex[:12]
        if body.get("stream"):
            chunk_delay = int(hdrs.get("x-stub-chunk-delay-ms", "0"))
            return StreamingResponse(
                _sse(completion_id, content, tool_call, finish, chunk_delay),
                media_type="text/event-stream",
                headers=extra_headers,
            )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_call:
            message["tool_calls"] = [tool_call]
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", MODEL),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 8,
                    "total_tokens": prompt_tokens + 8,
                },
            },
            headers=extra_headers,
        )


def _fill(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        props = schema.get("properties", {})
        return {name: _fill(sub) for name, sub in props.items()}
    if kind == "array":
        return []
    return {"integer": 1, "number": 1.5, "boolean": True}.get(str(kind), "x")


def _decide_tool_call(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Call a tool when tools are offered and the last message is not a tool result."""
    tools = body.get("tools") or []
    messages = body.get("messages") or []
    choice = body.get("tool_choice")
    if not tools or choice == "none" or (messages and messages[-1].get("role") == "tool"):
        return None, "stop"
    forced = isinstance(choice, dict)
    name = choice["function"]["name"] if forced else tools[0]["function"]["name"]
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    call = {
        "id": "call_" + uuid.uuid4().hex[:12],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(_fill(fn.get("parameters", {})))},
    }
    # Like OpenAI: a forced named tool answers "stop", an auto choice "tool_calls".
    return call, "stop" if forced else "tool_calls"


async def _sse(
    completion_id: str,
    content: str | None,
    tool_call: dict[str, Any] | None,
    finish: str,
    chunk_delay_ms: int,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        payload = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return f"data: {json.dumps(payload)}\n\n".encode()

    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if tool_call:
        deltas.append({"tool_calls": [{"index": 0, **tool_call}]})
    else:
        deltas += [{"content": word + " "} for word in (content or "").split()]
    for delta in deltas:
        yield chunk(delta)
        if chunk_delay_ms:
            await asyncio.sleep(chunk_delay_ms / 1000)
    yield chunk({}, finish)
    yield b"data: [DONE]\n\n"


class ServerThread:
    """Serve an ASGI app with uvicorn on a free loopback port in a daemon thread."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(5)
        self._sock.close()
