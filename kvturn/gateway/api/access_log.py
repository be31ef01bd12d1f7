"""The access log: one line per request on the ``kvturn.access`` logger, at INFO, written when
the reply has gone out.

Every request: method, path, status and duration. A turn adds what the reply's headers say
(:mod:`kvturn.headers`): its plan, the plan's reason and the tokens reused, the caller's
tenant, the conversation as a short digest of its key (tenant and id; the raw id is never
logged, nor is it in the path of a heartbeat or release), and for a streamed reply the time to
its first bytes. The middleware reads the reply at the edge, so the turn code knows nothing of
it; when the logger is off for INFO a request costs one level check.

Text: ``POST /v1/chat/completions 200 812.3ms tenant=alpha conversation=173939e503a9
plan=pull-reuse plan_reason=cheaper reused_tokens=992 ttft_ms=41.2``; with the JSON format
(:func:`kvturn.gateway.server.configure_logging`) each field is a key of the line's object.
``ttft_ms`` is the time to the reply's first bytes, for streamed replies only.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import unquote

from kvturn import control
from kvturn import headers as h
from kvturn.gateway.api.authenticate import TENANT_SCOPE_KEY
from kvturn.gateway.auth import scoped_key

#: The access log's logger.
ACCESS_LOGGER = logging.getLogger("kvturn.access")

#: Reply headers (as ASGI sends them) → the access log's field.
_FIELDS = {
    h.PLAN.lower().encode("latin-1"): "plan",
    h.PLAN_REASON.lower().encode("latin-1"): "plan_reason",
    h.REUSED_TOKENS.lower().encode("latin-1"): "reused_tokens",
    h.CONVERSATION_ID.lower().encode("latin-1"): "conversation",
}
_TEXT_ORDER = ("tenant", "conversation", "plan", "plan_reason", "reused_tokens", "ttft_ms")
_STREAM = b"text/event-stream"
#: The control API's paths, each naming a conversation by its raw id.
_CONVERSATIONS = "/v1" + control.CONVERSATIONS_PATH + "/"


def conversation_digest(tenant: str, conversation_id: str) -> str:
    """What the access log says for a conversation: the first 12 hex digits of its key in the
    table and on decode (:func:`~kvturn.gateway.auth.scoped_key`: a tenant's ``chat-1`` is
    never another's), the same from every gateway process and in every line of it."""
    return scoped_key(tenant, conversation_id)[2:14]


class AccessLog:
    """ASGI middleware: the access line of each HTTP request (outermost, so a refused key's
    401 is logged too)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not ACCESS_LOGGER.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        reply: dict[str, Any] = {}

        async def watch(message: Any) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                reply["status"] = message["status"]
                reply["headers"] = message.get("headers") or ()
            elif kind == "http.response.body" and "first" not in reply:
                reply["first"] = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            _log(scope, reply, start)


def _log(scope: Any, reply: dict[str, Any], start: float) -> None:
    tenant = scope.get(TENANT_SCOPE_KEY)
    path, conversation = _path(scope, tenant or "")
    fields: dict[str, Any] = {
        "method": scope["method"],
        "path": path,
        # No reply sent: an exception on its way to the server's error handler (a 500).
        "status": reply.get("status", 500),
        "duration_ms": round((time.perf_counter() - start) * 1000, 1),
    }
    if tenant:
        fields["tenant"] = tenant
    if conversation:
        fields["conversation"] = conversation
    streamed = False
    for raw_name, value in reply.get("headers", ()):
        name = raw_name.lower()  # the turn path sends its headers as kvturn.headers spells them
        field = _FIELDS.get(name)
        if field is not None:
            text = value.decode("latin-1")
            if field == "conversation":
                # The gateway's echo, as an id travels in a header (encoded where it must be).
                text = conversation_digest(tenant or "", h.conversation_id_from_header(text))
            elif field == "reused_tokens" and text.isdigit():
                fields[field] = int(text)
                continue
            fields[field] = text
        elif name == b"content-type" and value.startswith(_STREAM):
            streamed = True
    if streamed and "first" in reply:
        fields["ttft_ms"] = round((reply["first"] - start) * 1000, 1)
    text = " ".join(f"{k}={fields[k]}" for k in _TEXT_ORDER if k in fields)
    ACCESS_LOGGER.info(
        "%s %s %d %.1fms%s",
        fields["method"],
        fields["path"],
        fields["status"],
        fields["duration_ms"],
        " " + text if text else "",
        extra=fields,
    )


def _path(scope: Any, tenant: str) -> tuple[str, str | None]:
    """The request's path to log, a conversation id in it (a heartbeat's, a release's; routed
    or not) replaced by its digest; and that digest. The id is one percent-encoded segment of
    the path as sent (:func:`kvturn.control.path_segment`: it may hold ``/`` once decoded)."""
    path: str = scope["path"]
    if not path.startswith(_CONVERSATIONS):
        return path, None
    raw = scope.get("raw_path")
    sent = raw.decode("latin-1") if raw else path
    segment, slash, rest = sent[len(_CONVERSATIONS) :].partition("/")
    if not segment:
        return path, None
    digest = conversation_digest(tenant, unquote(segment))
    return _CONVERSATIONS + digest + slash + rest, digest
