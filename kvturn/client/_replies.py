"""Reading a reply for what the pause after it will be: does the model want tools run?

Read from the reply's JSON text as it goes by (see ``_bodies.py``), so it needs no SDK model
class: a chat completion (``finish_reason == "tool_calls"`` or a message carrying
``tool_calls``; a forced named ``tool_choice`` answers ``stop`` with tool calls), its stream
chunks, a Responses API object and its stream events.
"""

from __future__ import annotations

import json

__all__ = ["TOOL_MARK", "event_asks_for_tools"]

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
    """Whether a reply's JSON text (a whole body, or one streamed event) calls tools.

    Called only for texts that hold :data:`TOOL_MARK`: a chat chunk's tool call is recognised
    as text, anything else (Responses API events, other spacing, a text that merely mentions
    a tool call) costs a parse.
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
