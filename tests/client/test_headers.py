"""Turn headers: what they hold and how they land on a request."""

from __future__ import annotations

import httpx2
from openai._models import FinalRequestOptions

from kvturn import headers as h
from kvturn.client import OpenAI, Pause, conversation_id_from
from kvturn.client._base import tag_request_headers
from kvturn.client._headers import (
    _after_fork_in_child,
    header_item,
    new_turn_id,
    refill_turn_ids,
    turn_headers,
    turn_id_pool,
)


def test_turn_headers_carry_the_pause_only_when_there_was_one() -> None:
    assert turn_headers("c", "t", None) == {h.CONVERSATION_ID: "c", h.TURN_ID: "t"}
    assert turn_headers("c", "t", Pause(ms=7, kind="tool")) == {
        h.CONVERSATION_ID: "c",
        h.TURN_ID: "t",
        h.PAUSE_MS: "7",
        h.PAUSE_KIND: "tool",
    }


def test_the_client_sends_exactly_the_turn_headers() -> None:
    # The client builds its turns' headers in raw form on its own path: the same headers.
    now = [10.0]
    client = OpenAI(base_url="http://stub.invalid/v1", api_key="x", clock=lambda: now[0])
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    with client.conversation("c") as conversation:
        first = client._kvturn_begin(options)
        assert first is not None
        client._kvturn_finish(first, tool_calls=True)
        now[0] += 0.007
        second = client._kvturn_begin(options)
        assert second is not None
        client._kvturn_finish(second, tool_calls=False)
        conversation.released = True  # nothing to release at a gateway
    assert first.headers == turn_headers("c", first.turn_id, None)
    assert second.headers == turn_headers("c", second.turn_id, Pause(ms=7, kind="tool"))
    assert second.pause == Pause(ms=7, kind="tool") and first.pause is None
    client.close()


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


def test_tagging_replaces_same_named_headers_in_any_case() -> None:
    values = turn_headers("new", "t1", Pause(ms=3, kind="user"))
    items = tuple(header_item(name, value) for name, value in values.items())
    fast = httpx2.Headers({"x-conversation-id": "old", "Accept": "json"})
    tag_request_headers(fast, items)

    class NoInternals(dict[str, str]):
        pass  # no _list: the public item assignment path

    slow = NoInternals({"X-Conversation-Id": "old", "Accept": "json"})
    tag_request_headers(slow, items)
    assert fast.get_list("X-Conversation-Id") == ["new"]
    assert dict(fast) == {
        "accept": "json",
        "x-conversation-id": "new",
        "x-kvturn-turn-id": "t1",
        "x-kvturn-pause-ms": "3",
        "x-kvturn-pause-kind": "user",
    }
    assert slow["X-Conversation-Id"] == "new" and slow["X-Kvturn-Turn-Id"] == "t1"


def _capturing_client(**kwargs: object) -> tuple[OpenAI, list[httpx2.Request]]:
    seen: list[httpx2.Request] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        if request.url.path.endswith("/chat/completions"):
            seen.append(request)
        completion = {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
        }
        return httpx2.Response(200, json=completion)

    client = OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        max_retries=0,
        heartbeats=False,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
        **kwargs,  # type: ignore[arg-type]
    )
    return client, seen


def test_turn_headers_set_elsewhere_are_replaced_not_duplicated() -> None:
    # Among the client's default headers, and in one request's extra headers.
    client, seen = _capturing_client(
        default_headers={"x-conversation-id": "stale", "X-Kvturn-Pause-Kind": "tool"}
    )
    plain, plain_seen = _capturing_client()
    with client.conversation("c1") as conversation:
        client.chat.completions.create(model="m", messages=[])
    with plain.conversation("c2"):
        plain.chat.completions.create(
            model="m", messages=[], extra_headers={"X-Kvturn-Turn-Id": "stale"}
        )
        plain.chat.completions.create(model="m", messages=[], extra_headers={"X-Other": "1"})
    (request,) = seen
    assert request.headers.get_list("x-conversation-id") == ["c1"]
    assert request.headers.get_list("x-kvturn-turn-id") == [conversation.turns[0].turn_id]
    assert request.headers.get_list("x-kvturn-pause-kind") == []  # a first turn has no pause
    for request in plain_seen:
        assert request.headers.get_list("x-conversation-id") == ["c2"]
        (turn_id,) = request.headers.get_list("x-kvturn-turn-id")
        assert turn_id != "stale"
    client.close()
    plain.close()


def test_turn_ids_are_drawn_from_fresh_batches_after_a_fork() -> None:
    refill_turn_ids()
    assert turn_id_pool
    _after_fork_in_child()  # what a forked child runs: the parent's ids are not reused
    assert turn_id_pool == []
    assert len(new_turn_id()) == 32
