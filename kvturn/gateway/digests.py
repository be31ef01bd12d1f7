"""What a request is recognised by: chained digests of its messages (and of the reply that
extends them, :class:`ReplyCollector`), and a digest of its ``cache_salt``.

Implicit conversations, reuse for clients that send no conversation id, rest on the first.

A plain OpenAI client resends the whole history every turn: turn ``k + 1``'s messages are
turn ``k``'s messages, then turn ``k``'s reply, then what is new. The gateway keeps, for each
recent turn, one digest of *its messages plus its reply* (chained over messages, so a request's
digests of every prefix come from one pass over it) and the conversation it belonged to (the
index, :mod:`kvturn.gateway.state.implicit`). A request without an id whose messages start with
such a prefix is that conversation's next turn. Only prefixes that end with an assistant
message can be one: a conversation's first request is not looked up at all.

Matching only finds the conversation; it never decides what KV is reused. Every plan verifies
exact token ids (decode's prefix cache hashes them, prefill's pull checks the holder's digests),
so a false match, an edited message or a reply the client reformatted costs reuse, never an
answer. Two requests that extend the same turn (branches) both find it; the first takes its KV,
the other reads it on its decode without taking it (:mod:`kvturn.gateway.turns.sharing`), or
reuses what still matches, or recomputes. Digests are seeded with the caller's tenant,
the model and the request's ``cache_salt``, so tenants (and differently salted requests) never
match each other's turns.

The same chain tells whether a request extends the held turn's (:mod:`.extension`), and a
conversation keeps a digest of the ``cache_salt`` its KV was computed under
(:func:`salt_digest`). Each is computed once per turn (:class:`~.turns.model.Turn`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson

from kvturn.gateway.replies import SseData

#: Message fields that decide what the model sees (ids of tool calls are the engine's random
#: names that clients echo back, or not: left out, so either way matches).
_DIGEST_SIZE = 16


def _text(content: Any) -> str:
    """A message's content as one string: ``None`` and ``""`` alike, text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as data: frameworks re-serialise the JSON string they were given."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def canonical_message(message: dict[str, Any]) -> bytes:
    """The bytes a message is digested as: role, text, name and tool calls (name, arguments)."""
    calls = message.get("tool_calls") or ()
    content = message.get("content")
    role = message.get("role")
    if not calls and type(role) is str and (content is None or type(content) is str):
        # Most messages: plain text (no JSON encoding needed; 0x00 cannot occur in either).
        name = message.get("name")
        return b"\x00".join((role.encode(), (content or "").encode(), str(name).encode()))
    canonical: list[Any] = [message.get("role"), _text(message.get("content")), message.get("name")]
    if calls:
        canonical.append(
            [
                [
                    (call.get("function") or {}).get("name"),
                    _arguments((call.get("function") or {}).get("arguments")),
                ]
                for call in calls
                if isinstance(call, dict)
            ]
        )
    return orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)


def message_digests(seed: str, messages: Sequence[Any]) -> list[bytes]:
    """Digest ``i`` commits to the seed and ``messages[: i + 1]``."""
    digests: list[bytes] = []
    previous = hashlib.blake2b(seed.encode(), digest_size=_DIGEST_SIZE).digest()
    for message in messages:
        h = hashlib.blake2b(previous, digest_size=_DIGEST_SIZE)
        h.update(canonical_message(message) if isinstance(message, dict) else b"?")
        previous = h.digest()
        digests.append(previous)
    return digests


def extend(digest: bytes, message: dict[str, Any]) -> bytes:
    """The digest of the messages ``digest`` commits to, then ``message``."""
    h = hashlib.blake2b(digest, digest_size=_DIGEST_SIZE)
    h.update(canonical_message(message))
    return h.digest()


def prompt_key(digest: bytes) -> bytes:
    """What a turn of a conversation with an id is indexed by (:mod:`.turns.sharing`): the
    digest of its messages alone, set apart from every digest of messages (an implicit
    conversation's turns are indexed by their messages plus reply), so that a request without
    an id never continues a named conversation, and no reply need be rebuilt from a stream."""
    return hashlib.blake2b(digest, digest_size=_DIGEST_SIZE, person=b"kvturn-prompt").digest()


def salt_digest(cache_salt: object) -> bytes | None:
    """What a conversation keeps of a request's ``cache_salt``: 8 bytes, or ``None``."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(str(cache_salt).encode(), digest_size=8).digest()


def seed(tenant: str, model: Any, cache_salt: Any = None) -> str:
    """What every digest of a conversation starts from: requests of another tenant, for
    another model, or under another ``cache_salt`` (vLLM's promise that differently salted
    requests share no KV) never match."""
    return f"{tenant}\0{model}\0{cache_salt}"


class ReplyCollector:
    """Rebuilds the assistant message a streamed chat reply amounts to, from its SSE chunks
    (content and tool calls), as the client will send it back next turn."""

    __slots__ = ("_events", "calls", "content", "failed")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, list[str]]] = {}
        self.failed = False
        self._events = SseData()

    def feed(self, chunk: bytes) -> None:
        if self.failed:
            return
        for payload in self._events.feed(chunk):
            try:
                self._delta(orjson.loads(payload))
            except (orjson.JSONDecodeError, TypeError, AttributeError, ValueError):
                self.failed = True
                return

    def _delta(self, event: dict[str, Any]) -> None:
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.failed = True  # n > 1: which choice comes back is the client's to say
                return
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                slot = self.calls.setdefault(int(call.get("index", 0)), {"name": [], "args": []})
                function = call.get("function") or {}
                if function.get("name"):
                    slot["name"].append(function["name"])
                if function.get("arguments"):
                    slot["args"].append(function["arguments"])

    def message(self) -> dict[str, Any] | None:
        if self.failed:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": "".join(c["name"]), "arguments": "".join(c["args"])},
                }
                for _, c in sorted(self.calls.items())
            ]
        return message


def reply_message(response: dict[str, Any]) -> dict[str, Any] | None:
    """The assistant message of a non-streamed chat response with one choice."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, dict) else None
