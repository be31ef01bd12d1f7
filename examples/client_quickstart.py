"""kvturn.client quickstart: a multi-turn tool-calling agent on the drop-in OpenAI client.

    .venv/bin/python examples/client_quickstart.py --base-url http://127.0.0.1:8000/v1

Everything inside ``client.conversation()`` carries the conversation id, a turn id and the
pause before each turn; while the (deliberately slow) tool runs, the client renews the
conversation's lease through the gateway, and leaving the scope releases it. Each turn prints
what the gateway did with it: ``recompute`` on the first, reuse (``pull-reuse``) after. The
first request of each question names the tool in ``tool_choice``, so even a random-weight
model calls it; the answer turn uses ``tool_choice="none"``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvturn.client import Conversation, OpenAI

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
QUESTIONS = ["What is the weather in Paris?", "And in Rome?"]


def get_weather(arguments: str, tool_seconds: float) -> str:
    """The tool: slow on purpose, so the pause is long enough for heartbeats."""
    try:
        city = str(json.loads(arguments).get("city", "?"))
    except (ValueError, AttributeError):
        city = "?"  # small models may write broken JSON; the loop goes on
    time.sleep(tool_seconds)
    return json.dumps({"city": city, "sky": "sunny", "celsius": 21})


def show(step: str, conversation: Conversation) -> None:
    turn = conversation.last_turn
    assert turn is not None
    pause = f"{turn.pause.kind} pause {turn.pause.ms} ms" if turn.pause else "no pause"
    print(f"  {step:<7} {pause:<22} plan={turn.plan} reused_tokens={turn.reused_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--tool-seconds", type=float, default=2.0)
    parser.add_argument(
        "--user-seconds", type=float, default=1.0, help="think time between questions"
    )
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=1)
    model = args.model or client.models.list().data[0].id
    messages: list[Any] = [{"role": "system", "content": "Answer with the weather tool."}]
    force_tool = {"type": "function", "function": {"name": "get_weather"}}

    with client.conversation() as conversation:
        print(f"conversation {conversation.id} on {model}")
        for number, question in enumerate(QUESTIONS):
            if number:
                time.sleep(args.user_seconds)  # the user reads and types: a user pause
            messages.append({"role": "user", "content": question})
            print(f"user: {question}")

            reply = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice=force_tool,
                max_tokens=32, temperature=0,
            )  # fmt: skip
            show("call", conversation)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                arguments = getattr(call, "function", None)
                result = get_weather(arguments.arguments if arguments else "{}", args.tool_seconds)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

            answer = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice="none",
                max_tokens=48, temperature=0,
            )  # fmt: skip
            show("answer", conversation)
            text = answer.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            print(f"assistant: {text.strip()[:200]}")
    print(f"released {conversation.id} after {conversation.turn_count} turns")
    client.close()


if __name__ == "__main__":
    main()
