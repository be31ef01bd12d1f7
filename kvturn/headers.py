"""HTTP header names that carry a conversation's identity and what the gateway did with a turn."""

from __future__ import annotations

import re
from typing import Final, Literal

#: Stable id of the conversation a request belongs to (client → gateway).
CONVERSATION_ID: Final = "X-Conversation-Id"
#: Id of one turn, stable across the SDK's retries of that turn (client → gateway).
TURN_ID: Final = "X-Kvturn-Turn-Id"
#: Milliseconds between the end of the previous reply and this request (client → gateway).
PAUSE_MS: Final = "X-Kvturn-Pause-Ms"
#: What the pause was spent on: ``tool`` or ``user`` (client → gateway).
PAUSE_KIND: Final = "X-Kvturn-Pause-Kind"

#: How the gateway served the turn: ``recompute``, ``pull-reuse`` or ``decode-local``.
PLAN: Final = "X-Kvturn-Plan"
#: Why the gateway chose that plan (e.g. ``cheaper``, ``first-turn``, ``suffix-too-long``).
PLAN_REASON: Final = "X-Kvturn-Plan-Reason"
#: vllm-router's session header (vLLM's multi-turn benchmark sends it): read as a
#: conversation id when ``X-Conversation-Id`` is absent (client → gateway).
SESSION_ID: Final = "X-Session-ID"
#: How many prompt tokens came from KV the conversation already had.
REUSED_TOKENS: Final = "X-Kvturn-Reused-Tokens"

PauseKind = Literal["tool", "user"]
Plan = Literal["recompute", "pull-reuse", "decode-local"]

#: Conversation ids are opaque to kvturn but must be safe in headers, logs and metrics labels.
CONVERSATION_ID_MAX_LEN: Final = 128
_CONVERSATION_ID_RE: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def is_valid_conversation_id(value: str) -> bool:
    """Whether ``value`` is an acceptable conversation id (1 to 128 of ``A-Z a-z 0-9 . _ : -``)."""
    # fullmatch: ``$`` alone would also accept a trailing newline, which echoed back in the
    # X-Conversation-Id response header would split the reply's head.
    return bool(_CONVERSATION_ID_RE.fullmatch(value))


#: The longest pause a client may report (``X-Kvturn-Pause-Ms``, a heartbeat's ``paused_ms``):
#: a week. Longer values count as this; no pause model learns from an absurd one.
MAX_PAUSE_MS: Final = 7 * 24 * 3600 * 1000

#: Seconds a conversation's lease lasts without a turn or heartbeat (gateway → client, on every
#: response of a conversation). The client's first heartbeat of a pause comes at about half this.
LEASE_SECONDS: Final = "X-Kvturn-Lease-Seconds"

#: The caller's id for a request (client → gateway → engines, echoed on the reply), as vLLM's
#: server and routers take it.
REQUEST_ID: Final = "X-Request-Id"
#: W3C trace context (client → gateway → engines): the caller's trace, carried on.
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
