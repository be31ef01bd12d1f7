"""Recognising replies that ask for tools."""

from __future__ import annotations

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from kvturn.client._replies import asks_for_tools


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
