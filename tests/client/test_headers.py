"""Turn headers: what they hold and how they land on a request."""

from __future__ import annotations

import httpx2

from kvturn import headers as h
from kvturn.client import Pause, conversation_id_from
from kvturn.client._base import _set_headers
from kvturn.client._headers import new_turn_id, turn_headers


def test_turn_headers_carry_the_pause_only_when_there_was_one() -> None:
    assert turn_headers("c", "t", None) == {h.CONVERSATION_ID: "c", h.TURN_ID: "t"}
    assert turn_headers("c", "t", Pause(ms=7, kind="tool")) == {
        h.CONVERSATION_ID: "c",
        h.TURN_ID: "t",
        h.PAUSE_MS: "7",
        h.PAUSE_KIND: "tool",
    }


def test_turn_ids_are_unique_hex() -> None:
    ids = {new_turn_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_conversation_ids_from_framework_ids() -> None:
    assert conversation_id_from("thread-7") == "thread-7"
    digest = conversation_id_from("user 42/session")
    assert digest.startswith("h-") and h.is_valid_conversation_id(digest)
    assert conversation_id_from("user 42/session") == digest
    assert conversation_id_from("x" * 200) != conversation_id_from("x" * 201)


def test_set_headers_replaces_same_named_headers_in_any_case() -> None:
    values = turn_headers("new", "t1", Pause(ms=3, kind="user"))
    fast = httpx2.Headers({"x-conversation-id": "old", "Accept": "json"})
    _set_headers(fast, values)

    class NoInternals(dict[str, str]):
        pass  # no _list: the public item assignment path

    slow = NoInternals({"X-Conversation-Id": "old", "Accept": "json"})
    _set_headers(slow, values)
    assert fast.get_list("X-Conversation-Id") == ["new"]
    assert dict(fast) == {
        "accept": "json",
        "x-conversation-id": "new",
        "x-kvturn-turn-id": "t1",
        "x-kvturn-pause-ms": "3",
        "x-kvturn-pause-kind": "user",
    }
    assert slow["X-Conversation-Id"] == "new" and slow["X-Kvturn-Turn-Id"] == "t1"
