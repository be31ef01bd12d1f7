"""The turn endpoints (chat completions, completions, responses): a request's body and headers
read and checked, its conversation id found, and the turn handed to the gateway's
:class:`~kvturn.gateway.turns.runner.TurnRunner`; a Responses request is served as the chat turn it
amounts to (:mod:`kvturn.gateway.responses`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import orjson

from kvturn import headers as h
from kvturn.gateway import tracing
from kvturn.gateway.api.authenticate import TENANT_SCOPE_KEY
from kvturn.gateway.auth import tenant_salt
from kvturn.gateway.batches import BATCH_WINDOW, batched_prompts
from kvturn.gateway.callers import Admission
from kvturn.gateway.errors import BodyTooLarge, GatewayError, InvalidRequest
from kvturn.gateway.instance import Gateway
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.replies import Reply, error_reply, send_reply
from kvturn.gateway.responses.reply import answer_as_response
from kvturn.gateway.responses.translate import RESPONSES_PATH, Translated, translate
from kvturn.gateway.tokens import CHAT_PATH
from kvturn.gateway.turns.model import Turn
from kvturn.gateway.validation import check_request

logger = logging.getLogger("kvturn.gateway")

#: The turn endpoints.
TURN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", RESPONSES_PATH})

#: The request headers the turn path reads (ASGI gives names lower-cased, as bytes).
_TURN_HEADERS = {
    name.lower().encode("latin-1"): name
    for name in (
        *(h.CONVERSATION_ID, h.SESSION_ID, h.TURN_ID, h.PAUSE_MS, h.PAUSE_KIND, h.HEARTBEATS),
        *(h.REQUEST_ID, h.TRACEPARENT, h.TRACESTATE),
    )
}
#: The headers that name a conversation.
_ID_HEADERS = frozenset({h.CONVERSATION_ID, h.SESSION_ID})

#: The W3C trace context headers carried from the caller to the engines.
_TRACE_HEADERS = (h.TRACEPARENT, h.TRACESTATE)


class TurnEndpoint:
    """The turn endpoints (``TURN_PATHS``, POST): a raw ASGI endpoint among the app's routes,
    so the lifespan and every middleware (authentication, and any an operator adds) apply to
    turns as to every other route. It skips Starlette's request and response classes: this
    is the hot path (see :mod:`kvturn.gateway.replies`)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # One trace per turn (when tracing is on), until its reply is sent.
        span = tracing.start_turn(self.gateway.tracer, scope["path"], scope["headers"])
        status, headers = 500, {}
        admitted: Admission | None = None
        try:
            with tracing.current(span):
                try:
                    # Within its tenant's share of requests in flight, or refused before its
                    # body is read (:mod:`~kvturn.gateway.callers`).
                    admitted = self.gateway.callers.admit(scope[TENANT_SCOPE_KEY])
                    body = await _read_body(receive, self.gateway.config.max_body_bytes)
                except GatewayError as error:
                    reply = error_reply(error)
                else:
                    reply = await serve_turn(
                        self.gateway, scope["path"], scope["headers"], body, admitted
                    )
                status, headers = reply.status, reply.headers
                await send_reply(reply, receive, send)
        finally:
            # The reply is whole (a stream relayed to its end), failed, or its client left
            # (this task cancelled): the request leaves its tenant's count in every case.
            if admitted is not None:
                admitted.release()
            tracing.end_turn(span, status, headers)


async def serve_turn(
    gateway: Gateway,
    path: str,
    raw_headers: Iterable[tuple[bytes, bytes]],
    raw_body: bytes,
    admitted: Admission,
) -> Reply:
    """One request to a turn endpoint (``path`` in ``TURN_PATHS``) by an authenticated
    tenant, admitted within its limits (``admitted``). ``raw_headers`` as ASGI gives them
    (lower-case names, bytes)."""
    tenant = admitted.tenant
    headers: dict[str, str] = {}
    for name, value in raw_headers:
        wanted = _TURN_HEADERS.get(name)
        if wanted is not None:
            headers[wanted] = (
                _header_text(value) if wanted in _ID_HEADERS else value.decode("latin-1")
            )
    try:
        # The fields the gateway reads are checked here; everything else about the request is
        # the engine's to judge: prefill refuses a bad request before any work, with vLLM's
        # own error, which the client gets unchanged.
        body = _parse_body(raw_body)
        prompts = batched_prompts(path, body)
        # A batch's prompts run through a window of engine requests, as wide as its tenant has
        # left (one, the request's own, at the least).
        window = admitted.widen(min(len(prompts), BATCH_WINDOW)) if prompts else 1
        given = _header_id(headers)
        responses: Translated | None = None
        if path == RESPONSES_PATH:
            # Served as the chat turn it amounts to, and answered the Responses way.
            responses = await translate(body, gateway.responses, tenant)
            path, body = CHAT_PATH, responses.chat
            if given is None:
                given = responses.conversation_id or None
        check_request(path, body)
        if prompts and len(prompts) > gateway.config.caller_batch_prompts:
            limit = gateway.config.caller_batch_prompts
            raise InvalidRequest(
                f"Invalid 'prompt': at most {limit} prompts in one request here, not "
                f"{len(prompts)}.",
                param="prompt",
            )
        conversation_id = _conversation_id(given, body)
        turn_id = headers.get(h.TURN_ID)
        if turn_id is not None and len(turn_id) > 128:
            raise InvalidRequest("turn id is longer than 128 characters")
        if tenant:
            # Prefix caches (and so reuse) are never shared across tenants.
            body["cache_salt"] = tenant_salt(tenant, body.get("cache_salt"))
        pause = _record_pause(gateway.metrics, headers)
        turn = Turn(path, body, conversation_id, turn_id, pause=pause, tenant=tenant)
        turn.heartbeats = headers.get(h.HEARTBEATS, "").lower() == "on"
        turn.window = window
        turn.request_id = headers.get(h.REQUEST_ID)
        turn.trace_headers = {k: headers[k] for k in _TRACE_HEADERS if k in headers}
        turn.tracer = gateway.tracer
        reply = await gateway.runner.run(turn)
        if responses is not None:
            reply = await answer_as_response(responses, reply, gateway.responses, tenant)
    except GatewayError as error:
        if error.status >= 500:
            logger.warning("turn failed: %s", error.message)
        reply = error_reply(error)
    except Exception:
        logger.exception("unexpected error serving %s", path)
        reply = error_reply(GatewayError("internal gateway error"))
    request_id = headers.get(h.REQUEST_ID)
    if request_id is not None:
        reply.headers[h.REQUEST_ID] = request_id  # as it came, as vLLM's server echoes it
    return reply


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _header_text(value: bytes) -> str:
    """A conversation header's value: UTF-8 as some clients send it raw (curl does), else
    latin-1 as HTTP reads any other octet."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _header_id(headers: dict[str, str]) -> str | None:
    """The id a header names (``X-Conversation-Id``, else vllm-router's ``X-Session-ID``),
    percent-decoded when it came encoded (:func:`kvturn.headers.conversation_id_from_header`);
    an empty header is no header."""
    value = headers.get(h.CONVERSATION_ID) or headers.get(h.SESSION_ID)
    if not value:
        return None
    try:
        return h.conversation_id_from_header(value)
    except ValueError as error:
        raise InvalidRequest(f"invalid conversation id: {error}", param="conversation_id") from None


def _conversation_id(given: str | None, body: dict[str, Any]) -> str | None:
    """The id a header gave (``given``), else a ``conversation_id`` body field, else OpenAI's
    ``prompt_cache_key``; an empty one is none (the body's ``conversation_id`` is the
    gateway's alone: never sent on)."""
    named = body.pop("conversation_id", None)
    value: Any = given
    if value is None:
        value = named if named is not None and named != "" else body.get("prompt_cache_key")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequest("conversation id must be a string", param="conversation_id")
    check_conversation_id(value)
    return value


def check_conversation_id(value: str) -> None:
    """Refuse (400) a conversation id the gateway does not take (any string of 1 to
    :data:`~kvturn.headers.CONVERSATION_ID_MAX_BYTES` bytes without control characters:
    :func:`kvturn.headers.conversation_id_problem`)."""
    problem = h.conversation_id_problem(value)
    if problem is not None:
        raise InvalidRequest(f"invalid conversation id: {problem}", param="conversation_id")


def _record_pause(metrics: GatewayMetrics, headers: dict[str, str]) -> tuple[str, float] | None:
    """The pause the client reports before this turn, if it is a sane one: (kind, ms)."""
    pause_ms = headers.get(h.PAUSE_MS)
    kind = headers.get(h.PAUSE_KIND)
    if pause_ms is None or kind not in ("tool", "user"):
        return None
    try:
        ms = float(pause_ms)
    except ValueError:
        return None
    if not math.isfinite(ms) or ms < 0:
        return None  # nan or inf would poison the histogram (and the decode's pause model)
    ms = min(ms, h.MAX_PAUSE_MS)  # 1e308 is a week, not a value to skew eviction with
    metrics.pauses_by[kind].observe(ms / 1000)
    return kind, ms
