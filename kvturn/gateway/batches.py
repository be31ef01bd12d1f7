"""Completion requests with several prompts: one prefill/decode pair per prompt, one reply.

vLLM serves ``POST /v1/completions`` with a list of prompts as one request, but its prefill
answer carries a single ``kv_transfer_params`` (the first prompt's), so a decode handed that
for every prompt reads the first prompt's KV for all of them and answers the others wrongly.
vLLM's P/D protocol has no per-prompt transfer parameters, so the gateway splits the batch:
each prompt is a turn of its own through prefill and decode (concurrently), and the replies
are merged back into exactly what one engine answers for the batch:

- choice ``index`` = prompt position * ``n`` + the choice's own index (vLLM's numbering);
- one ``id`` and ``created`` for the whole reply (the first prompt's);
- ``usage`` summed over the prompts (``prompt_tokens_details`` is the last prompt's, as vLLM
  reports it); a streamed reply's usage chunk comes once, after every prompt's last chunk,
  then ``data: [DONE]``.

Streams are relayed prompt after prompt: the engines compute every prompt at once, and the
client matches chunks to prompts by ``index``, as it must for vLLM's interleaved stream too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson

from kvturn.gateway.replies import Reply, ReplyStream

_DONE = b"data: [DONE]"
_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def batched_prompts(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completion request that holds more than one, else None.

    A prompt is a string or a list of token ids; a list of several of either is a batch."""
    if path != "/v1/completions":
        return None
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None


#: Prompts of a non-streamed batch served at once: the rest wait their turn, so that one
#: request never holds more than this many engine requests (a streamed batch's prompts are
#: relayed in order, every stream open at once: bounded by ``MAX_BATCH_PROMPTS`` alone).
BATCH_WINDOW = 32


def windowed(
    serving: Sequence[Coroutine[Any, Any, Reply]], window: int = BATCH_WINDOW
) -> list[Coroutine[Any, Any, Reply]]:
    """``serving``, at most ``window`` of them under way at once (non-streamed replies)."""
    slots = asyncio.Semaphore(window)

    async def one(work: Coroutine[Any, Any, Reply]) -> Reply:
        async with slots:
            return await work

    return [one(work) for work in serving]


async def serve_batch(
    serving: Sequence[Coroutine[Any, Any, Reply]], *, stream: bool, choices_per_prompt: int
) -> Reply:
    """Await every prompt's reply (in the batch's order) and merge them into one."""
    if not stream:
        serving = windowed(serving)
    replies = await asyncio.gather(*serving, return_exceptions=True)
    errors = [r for r in replies if isinstance(r, BaseException)]
    answered = [r for r in replies if isinstance(r, Reply)]
    refused = [r for r in answered if r.status != 200]
    if errors or refused:
        # One prompt failed: the engine would have refused the whole batch.
        for reply in answered:
            if reply.stream is not None:
                await reply.stream.aclose()
        if errors:
            raise errors[0]
        return refused[0]
    headers = answered[0].headers
    if not stream:
        bodies = [orjson.loads(r.body) for r in answered]
        return Reply(200, orjson.dumps(merge_bodies(bodies, choices_per_prompt)), headers)
    streams = [r.stream for r in answered if r.stream is not None]
    return Reply(200, headers=headers, stream=BatchStream(streams, choices_per_prompt))


def merge_bodies(bodies: list[dict[str, Any]], choices_per_prompt: int) -> dict[str, Any]:
    """One completion body from each prompt's own, numbered as vLLM numbers a batch."""
    merged = dict(bodies[0])
    merged["choices"] = [
        _renumbered(choice, position, choices_per_prompt)
        for position, body in enumerate(bodies)
        for choice in body.get("choices") or []
    ]
    usages = [b.get("usage") for b in bodies]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = _summed(usages)  # type: ignore[arg-type]
    return merged


def _renumbered(choice: dict[str, Any], position: int, choices_per_prompt: int) -> dict[str, Any]:
    return {**choice, "index": position * choices_per_prompt + int(choice.get("index") or 0)}


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = dict(usages[-1])
    for key in _COUNTS:
        if all(isinstance(u.get(key), int) for u in usages):
            total[key] = sum(u[key] for u in usages)
    return total


class BatchStream:
    """Several prompts' streamed replies relayed as one (a :class:`~.replies.ReplyStream`):
    each event re-numbered and re-labelled as one engine labels a batch; the prompts' usage
    chunks held back and sent as one at the end."""

    def __init__(self, streams: list[ReplyStream], choices_per_prompt: int):
        self._streams = streams
        self._choices_per_prompt = choices_per_prompt
        self._position = 0
        self._pending = b""
        self._identity: dict[str, Any] | None = None
        self._usages: list[dict[str, Any]] = []
        self._usage_chunk: dict[str, Any] | None = None
        self._finished = False

    @property
    def at_end(self) -> bool:
        return self._finished

    async def next_chunk(self) -> bytes | None:
        while not self._finished:
            if self._position == len(self._streams):
                self._finished = True
                return self._closing()
            chunk = await self._streams[self._position].next_chunk()
            if chunk is None:
                self._position += 1
                self._pending = b""
                continue
            out = self._translate(chunk)
            if out:
                return out
        return None

    async def aclose(self) -> None:
        for stream in self._streams:
            await stream.aclose()

    def _translate(self, chunk: bytes) -> bytes:
        """The complete events in ``chunk`` (plus what an earlier chunk left), rewritten."""
        data = self._pending + chunk
        events = data.split(b"\n\n")
        self._pending = events.pop()
        return b"".join(self._event(e) for e in events if e.strip())

    def _event(self, event: bytes) -> bytes:
        payload = event.removeprefix(b"data: ").strip()
        if payload == _DONE.removeprefix(b"data: "):
            return b""  # one [DONE] for the whole batch, at the end
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(data, dict) or "choices" not in data:
            return event + b"\n\n"  # an error event: relayed as the engine sent it
        if self._identity is None:
            self._identity = {k: data[k] for k in ("id", "created") if k in data}
        data.update(self._identity)
        if not data["choices"] and isinstance(data.get("usage"), dict):
            self._usages.append(data["usage"])
            self._usage_chunk = data
            return b""
        data["choices"] = [
            _renumbered(c, self._position, self._choices_per_prompt) for c in data["choices"]
        ]
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _closing(self) -> bytes:
        usage = b""
        if self._usage_chunk is not None:
            self._usage_chunk["usage"] = _summed(self._usages)
            usage = b"data: " + orjson.dumps(self._usage_chunk) + b"\n\n"
        return usage + _DONE + b"\n\n"
