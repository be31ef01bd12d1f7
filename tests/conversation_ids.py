"""Conversation ids of every form a client may send (issue 40), shared by the gateway's unit
tests (``tests/unit/test_conversation_ids.py``) and the differential suite on real engines."""

from __future__ import annotations

from typing import Any

from kvturn import headers as h

#: name → id: the forms that were refused before issue 40, and the awkward corners of the rule.
ID_FORMS: dict[str, str] = {
    "email": "user@example.com",
    "spaces-and-slashes": "team a / chat 7",
    "url-like": "conv#42?x=1",
    "percent": "50% off, %2F not a slash",
    "non-ascii": "café ☕ 会话",
    "over-128": "x" * 1000 + "-long",
    "1024-bytes-utf8": "é" * 512,
    "padded": " padded ",
    "marker-alike": "UTF-8''not-encoded",
    "dots": "..",
    "route-alike": "a/heartbeat",
}

#: How a request names its conversation: the body's ``prompt_cache_key`` or either header.
WAYS = ("prompt_cache_key", h.SESSION_ID, h.CONVERSATION_ID)


def named(way: str, conversation_id: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(headers, extra body fields) that name ``conversation_id`` the ``way`` given."""
    if way == "prompt_cache_key":
        return {}, {"prompt_cache_key": conversation_id}
    return {way: h.conversation_id_header(conversation_id)}, {}
