"""Recognising replies that ask for tools, from their JSON text."""

from __future__ import annotations

import json

from kvturn.client._replies import _CLIENT_TOOL_ITEMS, TOOL_MARK, event_asks_for_tools


def _completion(finish: str, tool_calls: bool, **dumps: object) -> str:
    message: dict[str, object] = {"role": "assistant", "content": None if tool_calls else "hi"}
    if tool_calls:
        message["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]
    body = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }
    return json.dumps(body, **dumps)  # type: ignore[arg-type]


def test_chat_completions_whole_bodies() -> None:
    for dumps in ({}, {"indent": 2}, {"separators": (",", ":")}):
        assert event_asks_for_tools(_completion("tool_calls", True, **dumps))
        # A forced named tool_choice answers stop, with tool calls.
        assert event_asks_for_tools(_completion("stop", True, **dumps))
        assert not event_asks_for_tools(_completion("stop", False, **dumps))
        assert not event_asks_for_tools(_completion("length", False, **dumps))


def test_responses_api_whole_bodies() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc"}
    text = {"type": "message", "id": "m", "role": "assistant", "content": []}
    search = {"type": "web_search_call", "id": "ws", "status": "completed"}

    def response(items: list[dict[str, object]]) -> str:
        return json.dumps({"id": "r", "object": "response", "output": items})

    assert event_asks_for_tools(response([text, call]))
    assert not event_asks_for_tools(response([text]))
    assert not event_asks_for_tools(response([text, search]))  # hosted: runs server-side


def test_event_texts() -> None:
    def chunk(delta: dict[str, object], finish: str | None) -> str:
        body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return json.dumps(body)

    assert event_asks_for_tools(chunk({}, "tool_calls"))
    assert event_asks_for_tools(chunk({"tool_calls": [{"index": 0, "id": "c"}]}, None))
    assert not event_asks_for_tools(chunk({"content": 'the "tool_calls" key'}, None))
    assert not event_asks_for_tools(chunk({"tool_calls": []}, "stop"))
    call = {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}
    added = {"type": "response.output_item.added", "item": call}
    assert event_asks_for_tools(json.dumps(added))
    search = {"type": "response.output_item.done", "item": {"type": "web_search_call"}}
    assert not event_asks_for_tools(json.dumps(search))  # hosted: runs server-side
    done = {"type": "response.completed", "response": {"output": [call]}}
    assert event_asks_for_tools(json.dumps(done))
    assert event_asks_for_tools(chunk({"tool_calls": [{"index": 0}]}, None))  # spaced: sure
    assert event_asks_for_tools(chunk({"tool_calls": [{"index": 0}]}, None).replace(":", " :"))
    compact = chunk({"tool_calls": [{"index": 0, "id": "c"}]}, None).replace(" ", "")
    assert event_asks_for_tools(compact)
    assert event_asks_for_tools(chunk({}, "tool_calls").replace(" ", ""))
    # Mentioned in a text, even as compact JSON, it is escaped: parsed, and answered no.
    mention = chunk({"content": '{"tool_calls":[{"id": 1}]}'}, None).replace(": ", ":")
    assert '"tool_calls' in mention and not event_asks_for_tools(mention)
    assert not event_asks_for_tools("[DONE]")
    assert not event_asks_for_tools("not json _call")
    assert not event_asks_for_tools('["_call"]')


def test_every_tool_event_holds_the_mark() -> None:
    # Events are parsed only when their text holds TOOL_MARK: every name that makes one a tool
    # call must contain it, or such events would go unseen.
    assert TOOL_MARK in "tool_calls"
    assert all(TOOL_MARK in kind for kind in _CLIENT_TOOL_ITEMS)
