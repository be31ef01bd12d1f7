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

Prompts are served through a window (:data:`BATCH_WINDOW`, or fewer where the caller has
fewer engine requests left: :mod:`.callers`): a batch of 256 never opens 256 engine requests
at once. Every batch's prompts, of every tenant, also take turns in the gateway's one lane
(:class:`~.congestion.BulkLane`), which narrows while the event loop runs late: batches yield
the loop to every caller's turns. Streams are relayed prompt after prompt: the engines compute
the window's prompts at once, and the client matches chunks to prompts by ``index``, as it must
for vLLM's interleaved stream too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import orjson

from kvturn.gateway.congestion import BulkLane
from kvturn.gateway.errors import GatewayError, UpstreamError
from kvturn.gateway.replies import Reply, ReplyStream

logger = logging.getLogger("kvturn.gateway")

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


#: Prompts of a batch served at once: the rest wait their turn, so that one request never
#: holds more than this many engine requests (fewer where its tenant has fewer left:
#: :mod:`.callers`). A streamed prompt holds its place until its stream has been relayed.
BATCH_WINDOW = 32


async def windowed(
    serving: Sequence[Coroutine[Any, Any, Reply]],
    window: int = BATCH_WINDOW,
    lane: BulkLane | None = None,
) -> list[Reply | BaseException]:
    """Each of ``serving``'s replies (or what it raised), in order: at most ``window`` under
    way at once, each in its turn in the gateway's ``lane`` (:mod:`.congestion`).

    ``window`` workers serve the prompts one after another: a task per prompt, all made at
    once, would put every other caller's next step behind the batch's first steps."""
    replies: list[Reply | BaseException] = [_NOT_SERVED] * len(serving)
    pending = iter(enumerate(serving))

    async def worker() -> None:
        for position, work in pending:
            try:
                async with _in(lane, work):
                    replies[position] = await work
            except Exception as error:
                replies[position] = error

    workers = [asyncio.ensure_future(worker()) for _ in range(min(max(1, window), len(serving)))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for each in workers:
            each.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for _, work in pending:
            work.close()  # never started
        raise
    return replies


#: A prompt's place in :func:`windowed`'s answer before it has its reply.
_NOT_SERVED = GatewayError("the prompt was not served")


@contextlib.asynccontextmanager
async def _in(lane: BulkLane | None, work: Coroutine[Any, Any, Reply]) -> AsyncIterator[None]:
    """A place in ``lane`` (if any) for ``work``, until the block ends; ``work`` closed
    unstarted if it is called off while it waits."""
    if lane is None:
        yield
        return
    try:
        await lane.acquire()
    except asyncio.CancelledError:
        work.close()
        raise
    try:
        yield
    finally:
        lane.release()


async def serve_batch(
    serving: Sequence[Coroutine[Any, Any, Reply]],
    *,
    stream: bool,
    choices_per_prompt: int,
    window: int = BATCH_WINDOW,
    lane: BulkLane | None = None,
) -> Reply:
    """Serve every prompt (``serving``, in the batch's order), at most ``window`` at once,
    and merge their replies into one, each prompt in its turn in the gateway's ``lane``.

    A prompt that fails fails the batch, as the engine would refuse it whole: of a streamed
    batch, the prompts of the first window are answered before the reply starts; one after
    them that fails ends the stream with an error event, as vLLM ends a stream that failed."""
    if not stream:
        replies = await windowed(serving, window, lane)
        return _merged(replies, choices_per_prompt)
    prompts = PromptWindow(serving, window, lane)
    try:
        first = await asyncio.gather(*(prompts.reply(i) for i in range(min(window, len(prompts)))))
    except BaseException:
        await prompts.aclose()
        raise
    refused = _refused(first)
    if refused is not None:
        await prompts.aclose()
        if isinstance(refused, BaseException):
            raise refused
        return refused
    headers = first[0].headers if isinstance(first[0], Reply) else {}
    return Reply(200, headers=headers, stream=BatchStream(prompts, choices_per_prompt))


def _refused(replies: Sequence[Reply | BaseException]) -> Reply | BaseException | None:
    """What a batch with these prompts' replies fails with (an error first), if it fails."""
    errors = [r for r in replies if isinstance(r, BaseException)]
    if errors:
        return errors[0]
    return next((r for r in replies if isinstance(r, Reply) and r.status != 200), None)


def _merged(replies: Sequence[Reply | BaseException], choices_per_prompt: int) -> Reply:
    refused = _refused(replies)
    if isinstance(refused, BaseException):
        raise refused
    if refused is not None:
        return refused
    answered = [r for r in replies if isinstance(r, Reply)]
    bodies = [orjson.loads(r.body) for r in answered]
    merged = merge_bodies(bodies, choices_per_prompt)
    return Reply(200, orjson.dumps(merged), answered[0].headers)


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


class PromptWindow:
    """A batch's prompts served in order, at most ``window`` at once: a prompt takes its place
    before its engine requests start and keeps it until its reply is whole (a streamed one:
    relayed to its end, or closed). Places are taken strictly in the batch's order, so the
    prompt whose stream is relayed next always has one: a batch never waits on itself."""

    def __init__(
        self,
        serving: Sequence[Coroutine[Any, Any, Reply]],
        window: int,
        lane: BulkLane | None = None,
    ):
        loop = asyncio.get_running_loop()
        self._serving = list(serving)
        self._slots = asyncio.Semaphore(max(1, window))
        #: A prompt holds its place in the gateway's lane until its reply begins (a stream
        #: being relayed holds its place in the window, not in the lane).
        self._lane = lane
        self._replies: list[asyncio.Future[Reply | BaseException]] = [
            loop.create_future() for _ in self._serving
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._opener = loop.create_task(self._open())

    @classmethod
    def opened(cls, streams: Sequence[ReplyStream]) -> PromptWindow:
        """A window over streams already open (each a prompt's 200 reply)."""

        async def ready(stream: ReplyStream) -> Reply:
            return Reply(200, stream=stream)

        return cls([ready(s) for s in streams], len(streams))

    def __len__(self) -> int:
        return len(self._replies)

    async def reply(self, position: int) -> Reply | BaseException:
        """The reply of the prompt at ``position`` (or what it raised), once it has one."""
        return await self._replies[position]

    async def _open(self) -> None:
        for work, answer in zip(self._serving, self._replies, strict=True):
            await self._slots.acquire()
            self._tasks.append(asyncio.create_task(self._serve(work, answer)))

    async def _serve(
        self, work: Coroutine[Any, Any, Reply], answer: asyncio.Future[Reply | BaseException]
    ) -> None:
        outcome: Reply | BaseException
        try:
            async with _in(self._lane, work):
                outcome = await work
        except asyncio.CancelledError:
            self._slots.release()
            answer.cancel()
            raise
        except Exception as error:
            outcome = error
        if isinstance(outcome, Reply) and outcome.stream is not None:
            outcome.stream = _Held(outcome.stream, self._slots.release)
        else:
            self._slots.release()
        answer.set_result(outcome)

    async def aclose(self) -> None:
        """The batch's reply ended (whole, failed, or its client left): the prompts not
        started never start, those under way are called off, every stream is closed."""
        if self._closed:
            return
        self._closed = True
        self._opener.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(self._opener, *self._tasks, return_exceptions=True)
        for work in self._serving:
            # A prompt never started (or whose task was called off before it ran) is closed
            # unstarted; closing one that ran is a no-op.
            work.close()
        for answer in self._replies:
            if answer.done() and not answer.cancelled():
                reply = answer.result()
                if isinstance(reply, Reply) and reply.stream is not None:
                    await reply.stream.aclose()


class _Held:
    """A prompt's streamed reply, holding the prompt's place in its window until closed."""

    def __init__(self, stream: ReplyStream, release: Callable[[], None]):
        self._stream = stream
        self._release: Callable[[], None] | None = release

    @property
    def at_end(self) -> bool:
        return self._stream.at_end

    async def next_chunk(self) -> bytes | None:
        return await self._stream.next_chunk()

    async def aclose(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
            await self._stream.aclose()


class BatchStream:
    """Several prompts' streamed replies relayed as one (a :class:`~.replies.ReplyStream`):
    each event re-numbered and re-labelled as one engine labels a batch; the prompts' usage
    chunks held back and sent as one at the end. Each prompt's stream is closed (its place in
    the window given to the next prompt) as soon as it has been relayed to its end."""

    def __init__(self, prompts: PromptWindow | Sequence[ReplyStream], choices_per_prompt: int):
        self._prompts = (
            prompts if isinstance(prompts, PromptWindow) else PromptWindow.opened(prompts)
        )
        self._choices_per_prompt = choices_per_prompt
        self._position = 0
        self._stream: ReplyStream | None = None
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
            if self._stream is None:
                if self._position == len(self._prompts):
                    self._finished = True
                    return self._closing()
                reply = await self._prompts.reply(self._position)
                if isinstance(reply, BaseException) or reply.status != 200 or not reply.stream:
                    # A prompt past the first window failed, after the reply began: the
                    # stream ends as vLLM ends one that failed (an error event, [DONE]).
                    self._finished = True
                    return _error_event(reply) + _DONE + b"\n\n"
                self._stream = reply.stream
            chunk = await self._stream.next_chunk()
            if chunk is None:
                await self._stream.aclose()
                self._stream = None
                self._position += 1
                self._pending = b""
                continue
            out = self._translate(chunk)
            if out:
                return out
        return None

    async def aclose(self) -> None:
        await self._prompts.aclose()

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


def _error_event(failed: Reply | BaseException) -> bytes:
    """A failed prompt's error as a stream event: the engine's error body, or the gateway's."""
    if isinstance(failed, Reply):
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(failed.body)
            if isinstance(body, dict):
                return b"data: " + orjson.dumps(body) + b"\n\n"  # on one line, whatever it was
        error: GatewayError = UpstreamError(f"a prompt of the batch failed ({failed.status})")
    elif isinstance(failed, GatewayError):
        error = failed
    else:
        logger.error("a prompt of a streamed batch failed", exc_info=failed)
        error = GatewayError("internal gateway error")
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"
