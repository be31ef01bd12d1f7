"""The gateway's conversation control API: heartbeats and release.

Clients call these between turns. Paths are relative to the gateway's base URL (the same base
URL an OpenAI client uses, so ``/v1`` included).

``POST {base}/kvturn/conversations/{conversation_id}/heartbeat``
    Body :class:`HeartbeatRequest`; answer :class:`HeartbeatResponse`. Renews the
    conversation's lease while the agent is paused (a tool runs, a user types).
``DELETE {base}/kvturn/conversations/{conversation_id}``
    Answer :class:`ReleaseResponse`. The conversation is over: forget it and free its KV.

The id in a path is one segment, percent-encoded (RFC 3986, UTF-8: ``/``, ``?``, ``#``, ``%``,
spaces and non-ASCII included; :func:`path_segment`), so any conversation id
(:func:`kvturn.headers.conversation_id_problem`) has its own path; the gateway decodes it.

Unknown conversations are not errors: a heartbeat answers ``known: false`` (the client may stop
beating) and a release answers ``released: false``.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import quote

from pydantic import BaseModel, Field, field_validator

from kvturn.headers import MAX_PAUSE_MS, PauseKind

CONVERSATIONS_PATH: Final = "/kvturn/conversations"


def path_segment(conversation_id: str) -> str:
    """``conversation_id`` as one path segment: UTF-8, percent-encoded but for RFC 3986's
    unreserved characters, ``:`` and ``@`` (``a:b`` stays ``a:b``; ``a/b`` is ``a%2Fb``). An id
    of dots alone has them encoded too: HTTP clients remove ``.`` and ``..`` segments."""
    segment = quote(conversation_id, safe=":@")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


def heartbeat_path(conversation_id: str) -> str:
    """Path (relative to the base URL) of a conversation's heartbeat endpoint."""
    return f"{CONVERSATIONS_PATH}/{path_segment(conversation_id)}/heartbeat"


def release_path(conversation_id: str) -> str:
    """Path (relative to the base URL) that releases a conversation."""
    return f"{CONVERSATIONS_PATH}/{path_segment(conversation_id)}"


class HeartbeatRequest(BaseModel):
    """A client's report that the conversation is alive but paused."""

    pause_kind: PauseKind = "tool"
    #: Milliseconds since the last reply ended; longer than :data:`~kvturn.headers.MAX_PAUSE_MS`
    #: counts as that (a pause model fed 1e308 would skew every tenant's eviction order).
    paused_ms: int = Field(default=0, ge=0)

    @field_validator("paused_ms", mode="after")
    @classmethod
    def _clamped(cls, value: int) -> int:
        return min(value, MAX_PAUSE_MS)


class HeartbeatResponse(BaseModel):
    """Whether the gateway knows the conversation and how long its lease now runs."""

    conversation_id: str
    known: bool
    #: Seconds left on the conversation's lease after this heartbeat (0 when unknown).
    lease_remaining_s: float = 0.0
    #: Suggested seconds until the next heartbeat.
    next_heartbeat_s: float | None = None


class ReleaseResponse(BaseModel):
    """Whether a conversation was known and has been released."""

    conversation_id: str
    released: bool
