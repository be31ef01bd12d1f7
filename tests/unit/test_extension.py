"""The bound a turn that extends the held one is planned by (kvturn.gateway.extension): only
for a request that provably extends it, and never below what the models' real chat template
and tokenizers render the new messages to."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvturn.gateway.digests import message_digests, seed
from kvturn.gateway.extension import (
    BOUNDARY_TOKENS,
    messages_bound,
    new_tokens_bound,
    prompt_mark,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
FIRST = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List the files."},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}
NEXT = [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
]


def _bound(previous: dict[str, Any], body: dict[str, Any]) -> int | None:
    start = seed("", previous.get("model"))
    mark = prompt_mark(previous, message_digests(start, previous["messages"]))
    digests = message_digests(seed("", body.get("model")), body["messages"])
    return new_tokens_bound(body, digests, mark)


def test_a_request_that_extends_the_held_one_has_a_bound() -> None:
    previous = {"model": "m", "messages": FIRST, "tools": TOOLS}
    bound = _bound(previous, {"model": "m", "messages": [*FIRST, *NEXT], "tools": TOOLS})
    assert bound == messages_bound(NEXT)
    assert bound is not None and bound > sum(len(json.dumps(m)) for m in NEXT)


@pytest.mark.parametrize(
    "change",
    [
        "edited history",
        "fewer messages",
        "same messages",
        "other tools",
        "other model",
        "template option",
        "an image",
        "no mark",
    ],
)
def test_no_bound_unless_the_request_provably_extends_the_held_one(change: str) -> None:
    previous: dict[str, Any] = {"model": "m", "messages": FIRST, "tools": TOOLS}
    body: dict[str, Any] = {"model": "m", "messages": [*FIRST, *NEXT], "tools": TOOLS}
    if change == "edited history":
        body["messages"] = [FIRST[0], {"role": "user", "content": "List the dirs."}, *NEXT]
    elif change == "fewer messages":
        body["messages"] = FIRST[:1]
    elif change == "same messages":
        body["messages"] = FIRST
    elif change == "other tools":
        body["tools"] = []
    elif change == "other model":
        body["model"] = "n"
    elif change == "template option":
        body["chat_template_kwargs"] = {"enable_thinking": True}
    elif change == "an image":
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        body["messages"] = [*FIRST, *NEXT, {"role": "user", "content": [image]}]
    if change == "no mark":
        digests = message_digests(seed("", "m"), body["messages"])
        assert new_tokens_bound(body, digests, None) is None
    else:
        assert _bound(previous, body) is None


# ---- against the real templates and tokenizers -------------------------------------------------


@functools.cache
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from kvturn.gateway.ops.launch.local_models import (
        chat_template,
        ensure_model,
        smollm2_gguf_path,
    )

    if model == "tiny":
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("tiny")))
    else:
        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tokenizer, chat_template()


def _ids(model: str, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    tokenizer, template = _tokenizer(model)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=120) | st.sampled_from(
    ["<|im_end|>", "<tool_call>{}</tool_call>", "  \n\n  ", '"\\u00e9"', "é日本🙂"]
)
_ARGS = st.dictionaries(st.sampled_from(["cmd", "path", "n"]), _TEXT | st.integers(), max_size=3)


@st.composite
def _conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int]:
    """A conversation (user, then rounds of an assistant reply and a tool result or user
    message) and where its previous request ended (after a user or tool message)."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_TEXT)})
    messages.append({"role": "user", "content": draw(_TEXT)})
    ends = [len(messages)]
    for i in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            arguments = json.dumps(draw(_ARGS), ensure_ascii=draw(st.booleans()))
            call = {"id": f"c{i}", "type": "function",
                    "function": {"name": "run", "arguments": arguments}}  # fmt: skip
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": draw(_TEXT)})
        else:
            messages.append({"role": "assistant", "content": draw(_TEXT)})
            text = draw(_TEXT)
            content = text if draw(st.booleans()) else [{"type": "text", "text": text}]
            messages.append({"role": "user", "content": content})
        ends.append(len(messages))
    return messages, draw(st.sampled_from(ends[:-1]))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
@settings(max_examples=150, deadline=None)
@given(conversation=_conversations(), with_tools=st.booleans())
def test_the_bound_holds_for_the_models_template_and_tokenizers(
    model: str, conversation: tuple[list[dict[str, Any]], int], with_tools: bool
) -> None:
    """What the holder computes past the previous prompt never exceeds the bound: the
    previous prompt's tokens start the new prompt's (but for its last few, which appended text
    may merge with), and the new prompt is longer by at most the bound on the new messages."""
    messages, previous = conversation
    tools = TOOLS if with_tools else None
    before = _ids(model, messages[:previous], tools)
    after = _ids(model, messages, tools)
    verified = max(0, len(before) - BOUNDARY_TOKENS)
    assert after[:verified] == before[:verified]
    bound = messages_bound(messages[previous:])
    assert bound is not None
    assert len(after) - len(before) <= bound
