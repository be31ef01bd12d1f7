"""A Responses request as the chat request it amounts to: its input items as chat messages after
the history of the previous response (or of the named conversation), its tools, tool choice,
text format and sampling fields as chat fields."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvturn.gateway.errors import GatewayError, InvalidRequest
from kvturn.gateway.state.response_store import ResponseStore

RESPONSES_PATH = "/v1/responses"

#: Sampling fields a Responses request may carry that mean the same on a chat request (the
#: vLLM extras among them pass through as vLLM's own Responses server accepts them).
_PASSED_ON = (
    "model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "cache_salt", "user",
    "prompt_cache_key", "stop", "logit_bias", "top_logprobs", "stop_token_ids", "ignore_eos",
)  # fmt: skip


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class ResponsesRequest(BaseModel):
    """The fields of a Responses request the gateway reads; the rest pass on or are ignored."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]] = Field(default_factory=list)
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    store: StrictBool = True
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31 - 1)
    metadata: dict[str, StrictStr] | None = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None


@dataclass(slots=True)
class Translated:
    """A Responses request as the chat turn it is served as."""

    request: ResponsesRequest
    chat: dict[str, Any]
    #: The chat messages without the instructions: what the next chained turn starts from.
    history: list[dict[str, Any]]
    #: The ``conversation`` parameter, else the previous response's conversation.
    conversation_id: str | None
    response_id: str = field(default_factory=lambda: f"resp_{os.urandom(16).hex()}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"Response with id '{response_id}' not found.")


async def translate(body: dict[str, Any], store: ResponseStore, tenant: str) -> Translated:
    """The chat request a Responses request amounts to: the new input after the history of
    the previous response, or of the named conversation (both from ``store``, the caller's
    tenant's)."""
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not _union_branch(str(p)))
        raise InvalidRequest(f"invalid '{where}': {first['msg']}", param=where or None) from None
    if request.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if request.previous_response_id is not None and request.conversation is not None:
        raise InvalidRequest(
            "'previous_response_id' and 'conversation' cannot be used together",
            param="previous_response_id",
        )
    history: list[dict[str, Any]] = []
    conversation_id = _conversation_param(request.conversation)
    if conversation_id is not None:
        # Like OpenAI's conversations: the turn sees the conversation's items so far.
        history = copy.deepcopy(await store.conversation(tenant, conversation_id) or [])
    if request.previous_response_id is not None:
        stored = await store.get(tenant, request.previous_response_id)
        if stored is None:
            raise ResponseNotFound(
                f"Previous response with id '{request.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        # A copy: the new input may merge into its last message, and the stored history is
        # what every other turn chained to the same response starts from.
        history = copy.deepcopy(stored.messages)
        conversation_id = stored.conversation_id
    if isinstance(request.input, str):
        history.append({"role": "user", "content": request.input})
    else:
        _append_items(history, request.input)
    if not history:
        raise InvalidRequest("'input' must not be empty", param="input")
    messages = history
    if request.instructions:
        messages = [{"role": "system", "content": request.instructions}, *history]
    chat: dict[str, Any] = {"messages": messages}
    for name in _PASSED_ON:
        value = body.get(name)
        if value is not None:
            chat[name] = value
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    if request.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
    response_format = _chat_format(request.text)
    if response_format is not None:
        chat["response_format"] = response_format
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return Translated(request, chat, [dict(m) for m in history], conversation_id)


def _conversation_param(value: str | dict[str, Any] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    found = value.get("id")
    if not isinstance(found, str):
        raise InvalidRequest("'conversation' must be an id or {\"id\": ...}", param="conversation")
    return found


def _append_items(messages: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise InvalidRequest(f"input item {i} has no role", param=f"input[{i}].role")
            content = _content(item.get("content"), i)
            if role == "assistant":
                text = content if isinstance(content, str) else _first_text(content)
                if last is not None and not last.get("content"):
                    last["content"] = text
                else:
                    messages.append({"role": "assistant", "content": text})
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _string(item, "name", i),
                    "arguments": _string(item, "arguments", i),
                },
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(output, i)
            messages.append(
                {"role": "tool", "content": output, "tool_call_id": _string(item, "call_id", i)}
            )
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(
                f"input item {i}: type '{kind}' is not supported", param=f"input[{i}].type"
            )


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"input item {i} needs a string '{key}'", param=f"input[{i}].{key}")
    return value


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: text parts become chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input item {i}: content must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidRequest(
                f"input item {i}: content part '{kind}' is not supported",
                param=f"input[{i}].content",
            )
    return parts


def _first_text(parts: list[dict[str, Any]]) -> str:
    return str(parts[0].get("text", "")) if parts else ""


def _parts_text(output: Any, i: int) -> str:
    parts = _content(output, i)
    return parts if isinstance(parts, str) else "".join(str(p.get("text", "")) for p in parts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidRequest(
            f"tool {i}: only function tools are supported here", param=f"tools[{i}].type"
        )
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def _union_branch(part: str) -> bool:
    """Whether a part of pydantic's error location names a branch of a union (``str``,
    ``dict[str,any]``, ``list[...]``) rather than a field (``stream`` is a field)."""
    return part in ("str", "int", "float", "bool", "none") or ("[" in part and part.endswith("]"))


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be auto, none, required or a function", param="tool_choice"
    )


def _chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {k: v for k, v in form.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(f"text format '{form.get('type')}' is not supported", param="text.format")
