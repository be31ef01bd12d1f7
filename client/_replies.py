"""Reading a reply for what the pause after it will be: does the model want tools run?

Duck-typed over the shapes the openai SDK returns, so it needs no import of every model class:
chat completions (``finish_reason == "tool_calls"`` or a message carrying ``tool_calls``; a
forced named ``tool_choice`` answers ``stop`` with tool calls), their stream chunks, Responses
API objects and their stream events.
"""

from __future__ import annotations

import json
from typing import Any

from openai._legacy_response import LegacyAPIResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

__all__ = ["TOOL_MARK", "asks_for_tools", "event_asks_for_tools", "result_asks_for_tools"]

# Responses API output items the *client* must execute; hosted tools (web search, file search,
# code interpreter) run server-side and leave no pause.
_CLIENT_TOOL_ITEMS = frozenset(
    {
        "function_call",
        "custom_tool_call",
        "computer_call",
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
    }
)
_OUTPUT_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})


def asks_for_tools(reply: Any) -> bool:
    """Whether ``reply`` (a completion, chunk, Responses object or stream event) calls tools."""
    # Fast paths for the common shapes: a getattr() that misses on a pydantic model raises
    # and catches an AttributeError, which costs more than the rest of the check (per chunk).
    if type(reply) is ChatCompletionChunk:
        for chunk_choice in reply.choices:
            if chunk_choice.finish_reason == "tool_calls" or chunk_choice.delta.tool_calls:
                return True
        return False
    if type(reply) is ChatCompletion:
        for choice in reply.choices:
            if choice.finish_reason == "tool_calls" or choice.message.tool_calls:
                return True
        return False
    choices = getattr(reply, "choices", None)
    if choices:
        for choice in choices:
            if getattr(choice, "finish_reason", None) == "tool_calls":
                return True
            message = getattr(choice, "message", None) or getattr(choice, "delta", None)
            if message is not None and getattr(message, "tool_calls", None):
                return True
        return False
    kind = getattr(reply, "type", None)
    if kind in _OUTPUT_ITEM_EVENTS:
        return getattr(getattr(reply, "item", None), "type", None) in _CLIENT_TOOL_ITEMS
    if kind == "response.completed":
        reply = getattr(reply, "response", None)
    output = getattr(reply, "output", None)
    if isinstance(output, list):
        return any(getattr(item, "type", None) in _CLIENT_TOOL_ITEMS for item in output)
    return False


def result_asks_for_tools(result: object) -> bool:
    """Whether what ``request()`` returned (non-streamed, its body read) asks for tool calls."""
    if isinstance(result, LegacyAPIResponse):
        # with_raw_response (LangChain's path): the body is already read and parse() caches,
        # so the caller's own parse() costs nothing extra.
        try:
            return asks_for_tools(result.parse())
        except Exception:
            return False
    return asks_for_tools(result)


#: In the JSON of any event that :func:`event_asks_for_tools` can answer yes for: "tool_calls"
#: and every client tool item type end in it. Events without it need no parsing.
TOOL_MARK = "_call"


#: JSON, compact (vLLM, OpenAI) or with Python's default spacing, that can only be a chunk
#: calling tools: a quote inside a JSON string is escaped, so these never match a text that
#: merely mentions them.
_SURE_TOOL_CALLS = (
    '"tool_calls":[{',
    '"finish_reason":"tool_calls"',
    '"tool_calls": [{',
    '"finish_reason": "tool_calls"',
)


def event_asks_for_tools(data: str) -> bool:
    """:func:`asks_for_tools` for a streamed event's JSON text, before the SDK parses it.

    Called only for events whose text holds :data:`TOOL_MARK`: a chat chunk's tool call is
    recognised as text, anything else (Responses API events, other spacing, a text that
    merely mentions a tool call) costs a parse.
    """
    sure = _SURE_TOOL_CALLS
    if sure[0] in data or sure[1] in data or sure[2] in data or sure[3] in data:
        return True
    try:
        event = json.loads(data)
    except ValueError:
        return False
    if not isinstance(event, dict):
        return False
    choices = event.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") == "tool_calls":
                return True
            message = choice.get("delta") or choice.get("message")
            if isinstance(message, dict) and message.get("tool_calls"):
                return True
        return False
    kind = event.get("type")
    if kind in _OUTPUT_ITEM_EVENTS:
        item = event.get("item")
        return isinstance(item, dict) and item.get("type") in _CLIENT_TOOL_ITEMS
    if kind == "response.completed":
        event = event.get("response")
        if not isinstance(event, dict):
            return False
    output = event.get("output")
    if isinstance(output, list):
        return any(
            isinstance(item, dict) and item.get("type") in _CLIENT_TOOL_ITEMS for item in output
        )
    return False
