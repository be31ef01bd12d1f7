"""Reading a reply for what the pause after it will be: does the model want tools run?

Duck-typed over the shapes the openai SDK returns, so it needs no import of every model class:
chat completions (``finish_reason == "tool_calls"`` or a message carrying ``tool_calls``; a
forced named ``tool_choice`` answers ``stop`` with tool calls), their stream chunks, Responses
API objects and their stream events.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

__all__ = ["asks_for_tools"]

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
