"""Response objects: the skeleton a Responses reply starts from, its output items, usage and
status, the Response a non-streamed chat completion amounts to, and the chat message a
response's output amounts to (what a chained turn's history holds)."""

from __future__ import annotations

import os
import time
from typing import Any

from kvturn.gateway.responses.translate import Translated


def skeleton(t: Translated, status: str) -> dict[str, Any]:
    """A Response object without output (as ``response.created`` shows it)."""
    request = t.request
    response: dict[str, Any] = {
        "id": t.response_id,
        "object": "response",
        "created_at": t.created_at,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": t.chat.get("model") or "",
        "output": [],
        "parallel_tool_calls": t.chat.get("parallel_tool_calls", True),
        "previous_response_id": request.previous_response_id,
        "temperature": t.chat.get("temperature"),
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": request.tools or [],
        "top_p": t.chat.get("top_p"),
        "store": request.store,
        "text": request.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "usage": None,
    }
    if request.conversation is not None:
        response["conversation"] = {"id": t.conversation_id}
    return response


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_usage(usage: dict[str, Any] | None, cached: int) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def finish_response(response: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    response["completed_at"] = int(time.time())


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The chat message a response's output amounts to (what the next turn's history holds,
    as a client resending the output items would build it): none for an empty output."""
    if not output:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    return message


def response_from_chat(t: Translated, data: dict[str, Any], cached: int) -> dict[str, Any]:
    """The Response object a non-streamed chat completion amounts to."""
    response = skeleton(t, "completed")
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(message_item(new_item_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            call_item(
                new_item_id("fc"),
                call.get("id") or new_item_id("call"),
                function.get("name", ""),
                function.get("arguments", ""),
                "completed",
            )
        )
    response["output"] = output
    response["model"] = data.get("model") or response["model"]
    response["usage"] = response_usage(data.get("usage"), cached)
    finish_response(response, choice.get("finish_reason"))
    return response


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
