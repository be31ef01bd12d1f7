"""HTTP header names that carry a conversation's identity and what the gateway did with a turn."""

from __future__ import annotations

import re
from typing import Final, Literal
from urllib.parse import quote, unquote

#: Stable id of the conversation a request belongs to (client → gateway).
CONVERSATION_ID: Final = "X-Conversation-Id"
#: Id of one turn, stable across the SDK's retries of that turn (client → gateway).
TURN_ID: Final = "X-Kvturn-Turn-Id"
#: Milliseconds between the end of the previous reply and this request (client → gateway).
PAUSE_MS: Final = "X-Kvturn-Pause-Ms"
#: What the pause was spent on: ``tool`` or ``user`` (client → gateway).
PAUSE_KIND: Final = "X-Kvturn-Pause-Kind"
#: The client will send heartbeats through the pause after this turn (client → gateway;
#: ``on``): its lease need only outlast a heartbeat's period, not the whole pause.
HEARTBEATS: Final = "X-Kvturn-Heartbeats"

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

#: Conversation ids are the client's own strings (as OpenAI's ``prompt_cache_key`` is): any
#: text of 1 to this many bytes of UTF-8, without control characters (see
#: :func:`conversation_id_problem`). The gateway keys its state by a digest of the id (and the
#: tenant), never by the id itself, so no id reaches a key, a log line or a metric label.
CONVERSATION_ID_MAX_BYTES: Final = 1024
#: The marker of an id sent percent-encoded in a header (RFC 8187's ``ext-value``: charset,
#: empty language, then RFC 3986 percent-encoded UTF-8), e.g. ``UTF-8''caf%C3%A9`` for
#: ``café``. Matched without regard to case, as RFC 8187 reads a charset.
ENCODED_ID_PREFIX: Final = "UTF-8''"

# What an id may not hold: C0 controls, DEL and C1 controls (a header or a log line would
# break on them: Python's ``splitlines`` ends a line at U+001C-U+001E and U+0085 too), the
# line and paragraph separators, and unpaired surrogates (not UTF-8 at all).
_REFUSED_CHARACTERS: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# An id that travels in a header as itself: printable ASCII, no space at either end (a header
# value's ends are trimmed on the way) and not starting with the marker.
_HEADER_SAFE: Final = re.compile(r"[!-~](?:[ -~]*[!-~])?")
# RFC 8187's value-chars: attr-char or a percent-encoded octet.
_ENCODED_VALUE: Final = re.compile(r"(?:[A-Za-z0-9!#$&+\-.^_`|~]|%[0-9A-Fa-f]{2})*")


def conversation_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a conversation id (a sentence for a 400), or ``None`` when it
    can: any string of 1 to :data:`CONVERSATION_ID_MAX_BYTES` bytes of UTF-8 without control
    characters (U+0000-U+001F, U+007F-U+009F), U+2028, U+2029 or unpaired surrogates.

    An empty id is no id: callers treat an empty header or field as absent before asking."""
    if not value:
        return "a conversation id may not be empty"
    bad = _REFUSED_CHARACTERS.search(value)
    if bad is not None:
        return (
            f"a conversation id may not hold control characters (U+{ord(bad.group()):04X} "
            f"at position {bad.start()})"
        )
    if len(value) > CONVERSATION_ID_MAX_BYTES // 4 and (
        len(value.encode()) > CONVERSATION_ID_MAX_BYTES
    ):
        return f"a conversation id may be at most {CONVERSATION_ID_MAX_BYTES} bytes of UTF-8"
    return None


def is_valid_conversation_id(value: str) -> bool:
    """Whether ``value`` is an acceptable conversation id (:func:`conversation_id_problem`)."""
    return conversation_id_problem(value) is None


def conversation_id_header(value: str) -> str:
    """How the (valid) conversation id ``value`` travels in a header (``X-Conversation-Id``,
    ``X-Session-ID``, and the gateway's echo): itself when it is printable ASCII with no space
    at either end and does not start with :data:`ENCODED_ID_PREFIX`; otherwise that prefix and
    the id's UTF-8 percent-encoded (RFC 3986's unreserved characters kept), e.g.
    ``UTF-8''user%40example.com%20%E2%9C%93`` (a header value is ASCII on the wire).
    :func:`conversation_id_from_header` reverses it."""
    if _HEADER_SAFE.fullmatch(value) and not _has_marker(value):
        return value
    return ENCODED_ID_PREFIX + quote(value, safe="")


def conversation_id_from_header(value: str) -> str:
    """The conversation id a header value carries (see :func:`conversation_id_header`): a
    value with the marker is percent-decoded; any other is the id itself. Raises
    ``ValueError`` for a marked value that is not RFC 8187 percent-encoded UTF-8."""
    if not _has_marker(value):
        return value
    encoded = value[len(ENCODED_ID_PREFIX) :]
    if not _ENCODED_VALUE.fullmatch(encoded):
        raise ValueError(
            f"a conversation id header starting {ENCODED_ID_PREFIX} must be percent-encoded "
            "(RFC 8187)"
        )
    try:
        return unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(
            f"a conversation id header starting {ENCODED_ID_PREFIX} must percent-encode UTF-8"
        ) from None


def _has_marker(value: str) -> bool:
    return value[: len(ENCODED_ID_PREFIX)].upper() == ENCODED_ID_PREFIX


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
