"""Request shapes shared by the client tests."""

from __future__ import annotations

import itertools
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


REUSE_PLANS = ("decode-local", "pull-reuse")


def assert_reuse_and_pause_kinds(turns: Any) -> None:
    """Turn 1 computes; turn 2 reuses the KV turn 1 left; every pause has the right kind."""
    first, second = turns[0], turns[1]
    assert first.plan == "recompute" and first.pause is None
    assert second.plan in REUSE_PLANS, second
    assert (second.reused_tokens or 0) > 0, second
    for earlier, later in itertools.pairwise(turns):
        assert later.pause is not None
        assert later.pause.kind == ("tool" if earlier.tool_calls else "user"), (earlier, later)
