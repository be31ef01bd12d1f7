"""A chat turn's SSE stream as Responses SSE events (``response.created`` …
``response.completed``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from kvturn.gateway.replies import ReplyStream, SseData
from kvturn.gateway.responses.objects import (
    call_item,
    finish_response,
    message_item,
    new_item_id,
    response_usage,
    skeleton,
)
from kvturn.gateway.responses.translate import Translated


class ResponsesStream:
    """A chat turn's SSE stream as Responses SSE events (a
    :class:`~kvturn.gateway.replies.ReplyStream`).

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
        self.response = skeleton(t, "in_progress")
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
            item = message_item(new_item_id("msg"), "", status="in_progress")
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
            item = call_item(
                new_item_id("fc"),
                call.get("id") or new_item_id("call"),
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
                done = message_item(item["id"], text)
            else:
                self._emit(
                    out,
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
                done = call_item(item["id"], item["call_id"], item["name"], text, "completed")
            self._emit(out, "response.output_item.done", output_index=index, item=done)
            output.append(done)
        response = self.response
        response["output"] = output
        response["usage"] = response_usage(self.usage, self.cached)
        finish_response(response, self.finish_reason)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self._emit(out, kind, response=response)
        return response
