"""Request shapes shared by the client tests."""

from __future__ import annotations

from typing import Any

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

USER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_result(reply: Any) -> list[Any]:
    """The messages that answer ``reply``'s tool calls."""
    message = reply.choices[0].message
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": message.model_dump()["tool_calls"]},
        *(
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
            for call in message.tool_calls
        ),
    ]
