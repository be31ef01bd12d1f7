"""The Responses API (``/v1/responses``) on the chat-turn path.

A Responses request is translated into the chat request it amounts to and served as a chat
turn, through the same planner, plans, fallbacks, leases, headers and metrics; its reply (or
stream) is translated back into a Response object (or Responses SSE events). Nothing about KV
reuse is Responses-specific: the chat template renders the same history into the same tokens
whichever API carried it, so a conversation can even move between the two.

Why not hand ``/v1/responses`` to the engines (vLLM 0.32 serves it): vLLM keeps
``previous_response_id`` state in the memory of the one engine that produced the response, a
decode that the next turn's prefill cannot see; and each engine would need the whole history
anyway. Here the gateway keeps what a chained turn needs (its chat messages, the Response
object and the conversation it belongs to) in a :class:`ResponseStore`, bounded and expiring,
per tenant.

Input items become chat messages as vLLM's own Responses server builds them
(``vllm/entrypoints/openai/responses/utils.py``, ``construct_input_messages``): instructions
first as a system message (never carried to the next turn), message items as messages,
``function_call`` items as tool calls of an assistant message (merged into the one before when
it is the assistant's), ``function_call_output`` items as tool messages. Unlike vLLM, the
previous response's function calls are kept when a turn is chained (vLLM keeps only its text,
so a chained tool turn loses the call its output answers). Reasoning items are left out (no
model kvturn serves emits them); other item types (``item_reference``, hosted tools) get a 400.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvturn.gateway.errors import GatewayError, InvalidRequest
from kvturn.gateway.replies import Reply, ReplyStream, SseData
from kvturn.gateway.state.response_store import ResponseStore

RESPONSES_PATH = "/v1/responses"

#: Sampling fields a Responses request may carry that mean the same on a chat request (the
#: vLLM extras among them pass through as vLLM's own Responses server accepts them).
_PASSED_ON = (
    "model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "cache_salt", "user",
    "prompt_cache_key", "stop", "logit_bias", "top_logprobs",
)  # fmt: skip


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class _Request(BaseModel):
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

    request: _Request
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
        request = _Request.model_validate(body)
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


# ---- replies ---------------------------------------------------------------------------------


def _skeleton(t: Translated, status: str) -> dict[str, Any]:
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


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any] | None, cached: int) -> dict[str, Any] | None:
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


def _finish(response: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    response["completed_at"] = int(time.time())


def _item_id(prefix: str) -> str:
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
    response = _skeleton(t, "completed")
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(_item_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            _call_item(
                _item_id("fc"),
                call.get("id") or _item_id("call"),
                function.get("name", ""),
                function.get("arguments", ""),
                "completed",
            )
        )
    response["output"] = output
    response["model"] = data.get("model") or response["model"]
    response["usage"] = _usage(data.get("usage"), cached)
    _finish(response, choice.get("finish_reason"))
    return response


class ResponsesStream:
    """A chat turn's SSE stream as Responses SSE events (a :class:`~.replies.ReplyStream`).

    ``on_done`` gets the final Response object when the stream completes (not when it breaks
    off or the client leaves), before the last events go out."""

    def __init__(
        self,
        inner: ReplyStream,
        t: Translated,
        cached: int,
        on_done: Callable[[dict[str, Any]], Awaitable[None]],
    ):
        self.inner = inner
        self.t = t
        self.cached = cached
        self.on_done = on_done
        self.response = _skeleton(t, "in_progress")
        self.sequence = 0
        self.events = SseData()
        self.done = False
        self.started = False
        self.failed = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        #: Output items as they open: [item, chat tool-call index or None for text, text].
        self.items: list[list[Any]] = []
        self.text_item: list[Any] | None = None
        self.calls: dict[int, list[Any]] = {}

    @property
    def at_end(self) -> bool:
        return self.done

    async def next_chunk(self) -> bytes | None:
        while not self.done:
            out: list[bytes] = []
            if not self.started:
                self.started = True
                self._emit(out, "response.created", response=dict(self.response))
                self._emit(out, "response.in_progress", response=dict(self.response))
            chunk = await self.inner.next_chunk()
            if chunk is not None:
                self._feed(out, chunk)
            if chunk is None or self.inner.at_end or self.failed:
                completed = self._end(out)
                self.done = True
                if completed is not None:
                    await self.on_done(completed)
            if out:
                return b"".join(out)
        return None

    async def aclose(self) -> None:
        await self.inner.aclose()

    def _emit(self, out: list[bytes], kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")

    def _feed(self, out: list[bytes], chunk: bytes) -> None:
        for payload in self.events.feed(chunk):
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not self.failed:
                self._chunk(out, data)

    def _chunk(self, out: list[bytes], data: dict[str, Any]) -> None:
        error = data.get("error")
        if error is not None:
            error = error if isinstance(error, dict) else {"message": str(error)}
            self.failed = True
            self._emit(
                out,
                "error",
                code=str(error.get("code")) if error.get("code") is not None else None,
                message=str(error.get("message", "")),
                param=error.get("param"),
            )
            return
        if data.get("usage"):
            self.usage = data["usage"]
        if data.get("model"):
            self.response["model"] = data["model"]
        for choice in data.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._text(out, delta["content"])
            for call in delta.get("tool_calls") or ():
                self._call(out, call)

    def _open(self, out: list[bytes], item: dict[str, Any], index: int | None) -> list[Any]:
        entry = [item, index, ""]
        self.items.append(entry)
        self._emit(out, "response.output_item.added", output_index=len(self.items) - 1, item=item)
        return entry

    def _text(self, out: list[bytes], text: str) -> None:
        if self.text_item is None:
            item = _message_item(_item_id("msg"), "", status="in_progress")
            self.text_item = self._open(out, item, None)
            self._emit(
                out,
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self.text_item[2] += text
        self._emit(
            out,
            "response.output_text.delta",
            item_id=self.text_item[0]["id"],
            output_index=self.items.index(self.text_item),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, out: list[bytes], call: dict[str, Any]) -> None:
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        entry = self.calls.get(index)
        if entry is None:
            item = _call_item(
                _item_id("fc"),
                call.get("id") or _item_id("call"),
                function.get("name") or "",
                "",
                "in_progress",
            )
            entry = self.calls[index] = self._open(out, item, index)
        elif function.get("name"):
            entry[0]["name"] += function["name"]
        arguments = function.get("arguments")
        if arguments:
            entry[2] += arguments
            self._emit(
                out,
                "response.function_call_arguments.delta",
                item_id=entry[0]["id"],
                output_index=self.items.index(entry),
                delta=arguments,
            )

    def _end(self, out: list[bytes]) -> dict[str, Any] | None:
        """The closing events; the final Response object, unless the stream failed."""
        if self.failed:
            failed = self.response
            failed["status"] = "failed"
            failed["error"] = {"code": "server_error", "message": "the model's reply broke off"}
            self._emit(out, "response.failed", response=failed)
            return None
        output: list[dict[str, Any]] = []
        for index, (item, call_index, text) in enumerate(self.items):
            if call_index is None:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                self._emit(
                    out,
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
                self._emit(
                    out,
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
                done = _message_item(item["id"], text)
            else:
                self._emit(
                    out,
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
                done = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
            self._emit(out, "response.output_item.done", output_index=index, item=done)
            output.append(done)
        response = self.response
        response["output"] = output
        response["usage"] = _usage(self.usage, self.cached)
        _finish(response, self.finish_reason)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self._emit(out, kind, response=response)
        return response


async def responses_reply(
    t: Translated,
    reply: Reply,
    cached: int,
    on_done: Callable[[dict[str, Any]], Awaitable[None]],
) -> Reply:
    """The chat turn's reply as the Responses API answers; errors pass through unchanged."""
    if reply.status != 200:
        return reply
    if reply.stream is not None:
        stream = ResponsesStream(reply.stream, t, cached, on_done)
        return Reply(200, headers=reply.headers, stream=stream)
    response = response_from_chat(t, orjson.loads(reply.body), cached)
    await on_done(response)
    return Reply(200, orjson.dumps(response), reply.headers)


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
