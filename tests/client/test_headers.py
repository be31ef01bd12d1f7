"""Turn headers: what they hold and how they land on a request."""

from __future__ import annotations

from kvturn_test_helpers import http

from kvturn import headers as h
from kvturn.client import OpenAI, Pause, conversation_id_from
from kvturn.client._conversation import begin_turn, finish_turn
from kvturn.client._headers import _reseed_after_fork, _turn_rng, new_turn_id, turn_headers
from kvturn.client._hooks import attempt_started


def test_turn_headers_carry_the_pause_only_when_there_was_one() -> None:
    assert turn_headers("c", "t", None) == {h.CONVERSATION_ID: "c", h.TURN_ID: "t"}
    assert turn_headers("c", "t", Pause(ms=7, kind="tool")) == {
        h.CONVERSATION_ID: "c",
        h.TURN_ID: "t",
        h.PAUSE_MS: "7",
        h.PAUSE_KIND: "tool",
    }


def test_turns_carry_exactly_the_turn_headers() -> None:
    now = [10.0]
    client = OpenAI(base_url="http://stub.invalid/v1", api_key="x", clock=lambda: now[0])
    with client.conversation("c") as conversation:
        first = begin_turn(conversation)
        finish_turn(first, tool_calls=True)
        now[0] += 0.007
        second = begin_turn(conversation)
        finish_turn(second, tool_calls=False)
        conversation.released = True  # nothing to release at a gateway
    assert first.headers == turn_headers("c", first.turn_id, None, heartbeats=True)
    assert second.headers == turn_headers(
        "c", second.turn_id, Pause(ms=7, kind="tool"), heartbeats=True
    )
    assert second.pause == Pause(ms=7, kind="tool") and first.pause is None
    client.close()


def test_turn_ids_are_unique_hex() -> None:
    ids = {new_turn_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_conversation_ids_from_framework_ids() -> None:
    # Any id a conversation may have is taken as it is (issue 40); the rest is digested.
    for given in ("thread-7", "user 42/session", "ü" * 512, "x" * 1024):
        assert conversation_id_from(given) == given
    for refused in ("", "line\nbreak", "x" * 1025, "ü" * 513, "\ud800"):
        digest = conversation_id_from(refused)
        assert digest.startswith("h-") and h.is_valid_conversation_id(digest)
        assert conversation_id_from(refused) == digest
    assert conversation_id_from("x" * 1025) != conversation_id_from("x" * 1026)


def test_the_request_hook_replaces_same_named_headers_in_any_case() -> None:
    client = OpenAI(base_url="http://stub.invalid/v1", api_key="x", heartbeats=False)
    request = http.Request(
        "POST",
        "http://stub.invalid/v1/chat/completions",
        headers={"x-conversation-id": "old", "X-KVTURN-TURN-ID": "stale", "Accept": "json"},
    )
    with client.conversation("new", release=False) as conversation:
        attempt_started(request)
    (turn,) = conversation.turns
    assert request.headers.get_list("X-Conversation-Id") == ["new"]
    assert {k: v for k, v in request.headers.items() if k not in ("host", "content-length")} == {
        "accept": "json",
        "x-conversation-id": "new",
        "x-kvturn-turn-id": turn.turn_id,
    }
    client.close()


def _capturing_client(**kwargs: object) -> tuple[OpenAI, list[http.Request]]:
    seen: list[http.Request] = []

    def answer(request: http.Request) -> http.Response:
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
        return http.Response(200, json=completion)

    client = OpenAI(
        base_url="http://stub.invalid/v1",
        api_key="x",
        max_retries=0,
        heartbeats=False,
        http_client=http.Client(transport=http.MockTransport(answer)),
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


def test_a_forked_child_draws_other_turn_ids_than_its_parent() -> None:
    state = _turn_rng.getstate()
    parent_next = new_turn_id()
    _turn_rng.setstate(state)
    _reseed_after_fork()  # what a forked child runs
    assert new_turn_id() != parent_next
