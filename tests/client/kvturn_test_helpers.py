"""Request shapes and the HTTP library shared by the client tests."""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import httpx
import openai

try:
    import httpx2
except ImportError:  # openai 1.x and 2.x are built on httpx alone
    httpx2 = None


def _sdk_http_library() -> ModuleType:
    if httpx2 is not None and issubclass(openai.DefaultHttpxClient, httpx2.Client):
        return httpx2
    return httpx


#: The HTTP library the installed openai SDK is built on (httpx2 from openai 3.x, httpx
#: before): tests make their mock transports and HTTP clients with it.
http: Any = _sdk_http_library()

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


#: The plans that reuse a conversation's KV: what the real gateway produces today (and so the
#: stand-in; ``test_stub_gateway.py`` checks that they agree).
REUSE_PLANS = ("pull-reuse", "decode-local")


def assert_reuse_and_pause_kinds(turns: Any) -> None:
    """Turn 1 computes; turn 2 reuses the KV turn 1 left; every pause has the right kind."""
    first, second = turns[0], turns[1]
    assert first.plan == "recompute" and first.pause is None
    assert second.plan in REUSE_PLANS, second
    assert (second.reused_tokens or 0) > 0, second
    for earlier, later in itertools.pairwise(turns):
        assert later.pause is not None
        assert later.pause.kind == ("tool" if earlier.tool_calls else "user"), (earlier, later)


def assert_tool_ran_per_question(turns: Any, questions: int) -> None:
    """Each question's first model call (the call after no pause or a user pause: the tool is
    forced there) asked for the tool, so a tool pause follows it. A model with random weights
    may ask again once the tool is no longer forced: later calls are not constrained."""
    firsts = [t for t in turns if t.pause is None or t.pause.kind == "user"]
    assert len(firsts) == questions, turns
    assert all(t.tool_calls for t in firsts), turns
