"""Recognising replies that ask for tools."""

from __future__ import annotations

import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from kvturn.client._replies import (
    _CLIENT_TOOL_ITEMS,
    TOOL_MARK,
    asks_for_tools,
    event_asks_for_tools,
)


def _completion(finish: str, tool_calls: bool) -> ChatCompletion:
    message: dict[str, object] = {"role": "assistant", "content": None if tool_calls else "hi"}
    if tool_calls:
        message["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]
    return ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
    )


def test_chat_completions() -> None:
    assert asks_for_tools(_completion("tool_calls", True))
    assert asks_for_tools(_completion("stop", True))  # forced named tool_choice answers stop
    assert not asks_for_tools(_completion("stop", False))
    assert not asks_for_tools(_completion("length", False))


def test_chunks() -> None:
    def chunk(delta: dict[str, object], finish: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk.model_validate(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    assert asks_for_tools(chunk({}, "tool_calls"))
    assert asks_for_tools(chunk({"tool_calls": [{"index": 0, "id": "c"}]}, None))
    assert not asks_for_tools(chunk({"content": "hi"}, None))
    assert not asks_for_tools(chunk({}, "stop"))


def _response(items: list[dict[str, object]]) -> Response:
    return Response.model_validate(
        {
            "id": "r",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "output": items,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )


def test_responses_api() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc"}
    text = {
        "type": "message",
        "id": "m",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "hi", "annotations": []}],
    }
    assert asks_for_tools(_response([text, call]))
    assert not asks_for_tools(_response([text]))


def test_unknown_objects_do_not_ask() -> None:
    assert not asks_for_tools(object())
    assert not asks_for_tools(None)


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
