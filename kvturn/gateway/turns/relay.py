"""Decode's streamed reply on its way to the client: the first token observed (TTFT, and what
decode added after prefill), the turn counted, and its reply settled when the stream ends or
is closed; a migratable reply continued on another engine when its own breaks off or hangs
(:mod:`.migrate`); and calling off a decode request whose reply the client will never see."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson

from kvturn.gateway import tracing
from kvturn.gateway.digests import ReplyCollector
from kvturn.gateway.errors import GatewayError, UpstreamError
from kvturn.gateway.http.upstream import StreamResponse, UpstreamUnavailable, next_chunk
from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply, ReplyStream, failure_event
from kvturn.gateway.turns.migrate import Migration
from kvturn.gateway.turns.model import PrefillResult
from kvturn.gateway.turns.replay import Replay
from kvturn.gateway.turns.settle import After, Settlement

logger = logging.getLogger("kvturn.gateway")

#: The end of a whole streamed reply.
SSE_DONE = b"data: [DONE]\n\n"
#: The event a streamed reply ends with when decode's stream breaks off mid-way.
STREAM_BROKE = (
    b"data: "
    + orjson.dumps(
        UpstreamError("the decode engine's stream broke off before the reply was complete").body()
    )
    + b"\n\n"
)


async def reply_start(upstream: StreamResponse) -> list[bytes] | None:
    """Read decode's stream up to its first event that says more than the reply's role (a
    token, a finish, usage, or the stream's end): the chunks read, to relay first; ``None`` if
    an error event of a failure (5xx) came first. vLLM answers a streamed request with 200 at
    once and reports a failure inside the stream (``data: {"error": ...}``), as it does when
    decode's read of the prompt's KV fails (a prefill host that stopped answering: the read
    times out, see :mod:`kvturn.gateway.ops.launch.engines`): no byte of a reply has reached
    the client then, and the turn can be served again. The role comes with the first token, so
    waiting for it delays nothing. Raises :class:`UpstreamUnavailable` if the stream breaks off
    first."""
    chunks: list[bytes] = []
    pending = b""
    while True:
        chunk = await next_chunk(upstream)
        if chunk is None:
            return chunks
        chunks.append(chunk)
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            said = _says(event)
            if said == "error":
                return None
            if said == "more":
                return chunks


def _says(event: bytes) -> str:
    """``error``, ``role`` (only the reply's role, or nothing), or ``more``, of one SSE event."""
    lines = event.strip().splitlines()
    data_lines = [line[5:].strip() for line in lines if line.startswith(b"data:")]
    if not data_lines:
        return "role"  # a comment or a keep-alive
    if any(line.startswith(b"event:") for line in lines):
        return "more"  # a named event, not a chat chunk: relayed as it comes
    data = b"\n".join(data_lines)
    if data == b"[DONE]":
        return "more"
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "more"  # not ours to judge: relay it
    if not isinstance(payload, dict):
        return "more"
    if "error" in payload:
        # vLLM reports a failure while generating (a KV read that failed among them) as a 5xx;
        # what it says of the request itself (4xx) is the reply, relayed as it comes.
        return "error" if failure_event(payload) else "more"
    if payload.get("usage"):
        return "more"
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            return "more"
        delta = choice.get("delta")
        if choice.get("finish_reason") or not isinstance(delta, dict):
            return "more"
        if any(value for key, value in delta.items() if key != "role"):
            return "more"
    return "role"


T = TypeVar("T")


class HangWatch:
    """Calls off a stream's read once its engine hangs: health checks mark it unhealthy (a
    hung engine answers none of them) and it has sent nothing for ``quiet_s``. A stream whose
    tokens still flow is never called off, whatever its engine's health checks say (an engine
    too busy to answer one in time is no hung engine). One task a stream, waking every
    ``every_s``; a read it calls off raises :class:`TimeoutError`."""

    def __init__(self, quiet_s: float, every_s: float = 0.5):
        self.quiet_s = quiet_s
        self.every_s = every_s
        #: When the read under way began: how long its engine has sent nothing (the time a
        #: slow client took between reads is no engine's silence).
        self.since = time.monotonic()
        self._reading: asyncio.Timeout | None = None
        self._task: asyncio.Task[None] | None = None

    async def read(self, engine: Callable[[], Instance], chunk: Awaitable[T]) -> T:
        """``chunk``, read from ``engine()`` (the engine the stream is on now)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch(engine))
        self.since = time.monotonic()
        try:
            async with asyncio.timeout(None) as self._reading:
                return await chunk
        finally:
            self._reading = None

    async def _watch(self, engine: Callable[[], Instance]) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            reading = self._reading
            quiet = time.monotonic() - self.since
            if reading is not None and not engine().healthy and quiet >= self.quiet_s:
                reading.reschedule(asyncio.get_running_loop().time())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Relay:
    """Decode's streamed reply on its way to the client (a
    :class:`~kvturn.gateway.replies.ReplyStream`): observes TTFT at the first chunk; when the
    stream ends or is closed, frees the instance and records where the conversation's KV now
    lives (nowhere, if the stream broke off)."""

    def __init__(
        self,
        settlement: Settlement,
        upstream: StreamResponse,
        instance: Instance,
        prefilled: PrefillResult,
        after: After,
        started: float,
        sent: float,
        spans: tracing.DecodeSpans | None = None,
        head: list[bytes] | None = None,
        migration: Migration | Replay | None = None,
        hang_quiet_s: float = 2.0,
    ):
        #: What :func:`reply_start` read already, relayed first.
        self.head = list(head or ())
        self.settlement = settlement
        self.upstream = upstream
        self.prefilled = prefilled
        self.after = after
        self.instance = instance
        self.started = started
        self.sent = sent
        self.spans = spans
        self.collector = ReplyCollector() if after.implicit is not None else None
        self.first = True
        self.closed = False
        self.broken = False
        #: Decode's ``[DONE]`` was relayed: the reply is whole, whatever comes after.
        self.done = False
        #: Where the reply may continue if decode's stream breaks (:mod:`.migrate`), and the
        #: stream it continues on once it has.
        self.migration = migration
        self.continued: ReplyStream | None = None
        self.continued_on: Instance | None = None
        #: A migratable reply's engine that hangs is left, as one whose stream broke off.
        self.hangs = HangWatch(hang_quiet_s) if migration is not None else None
        #: A failure seen after events that went out first: (why, engine unreachable).
        self.failure: tuple[str, bool] | None = None

    @property
    def at_end(self) -> bool:
        if self.migration is not None:
            return False  # whole events only, and perhaps another engine's: asked once more
        return not self.head and self.upstream.at_end

    async def next_chunk(self) -> bytes | None:
        if self.broken:
            return None
        if self.migration is not None:
            chunk = await self._migratable_chunk(self.migration)
        else:
            try:
                chunk = self.head.pop(0) if self.head else await next_chunk(self.upstream)
            except UpstreamUnavailable as error:
                return self._broke(str(error))
        if chunk is not None:
            if chunk.endswith(SSE_DONE):
                # The client has the whole reply once this is relayed, and may close at once.
                self.done = True
            if self.first:
                self.first = False
                if self.spans is not None:
                    self.spans.first_token()
                now = time.perf_counter()
                settlement, prefilled = self.settlement, self.prefilled
                settlement.context.metrics.ttft_by[prefilled.plan.plan].observe(now - self.started)
                settlement.count(prefilled, self.instance)
                since = prefilled.finished_at if prefilled.instance is not None else self.sent
                settlement.learn_first_token(prefilled, self.instance, now - since)
            if self.collector is not None:
                self.collector.feed(chunk)
        return chunk

    def _broke(self, why: str, counted: bool = False) -> bytes:
        """Too late to retry the turn, and no engine to continue it on: tell the client the
        OpenAI way (the SDK raises an APIError for an error event) rather than cutting the
        connection. ``counted``: the decode's failure is counted already."""
        logger.warning("decode's stream broke off: %s", why)
        if not counted:
            self.settlement.context.metrics.upstream_errors_by["decode"].inc()
        self.broken = True
        return STREAM_BROKE

    async def _migratable_chunk(self, migration: Migration | Replay) -> bytes | None:
        """The next whole events of a migratable reply, from decode or, once its stream broke
        off, from the engine the reply continues on (:mod:`.migrate`)."""
        while True:
            failure, self.failure = self.failure, None
            if failure is None:
                raw: bytes | None
                assert self.hangs is not None
                try:
                    if self.head:
                        raw = self.head.pop(0)
                    elif self.continued is not None:
                        raw = await self.hangs.read(self._engine, self.continued.next_chunk())
                    else:
                        raw = await self.hangs.read(self._engine, next_chunk(self.upstream))
                except UpstreamUnavailable as error:
                    failure = (str(error), True)
                except TimeoutError:
                    quiet = self.hangs.quiet_s
                    failure = (f"marked unhealthy, and nothing came for {quiet:g} s", True)
                else:
                    if raw is None and migration.ledger.done:
                        return None
                    if raw is None:
                        failure = ("the stream ended before the reply was complete", False)
                    else:
                        feed = migration.seam if self.continued is not None else migration.ledger
                        out, broke = feed.feed(raw)
                        if broke:
                            failure = ("an error event", False)
                        if out:
                            # Events before a failure's are the client's all the same; the
                            # failure is handled on the next call.
                            self.failure = failure
                            return out
                        if failure is None:
                            continue
            why, unreachable = failure
            if not await self._migrate(migration, why, unreachable):
                return self._broke(why, counted=True)
            held = await migration.held_event()
            if held:
                return held

    def _engine(self) -> Instance:
        """The engine the reply is coming from now."""
        return self.continued_on or self.instance

    async def _migrate(self, migration: Migration | Replay, why: str, unreachable: bool) -> bool:
        """Continue the reply on another engine; whether it does."""
        context = self.settlement.context
        context.metrics.upstream_errors_by["decode"].inc()
        broken_on = self._engine()
        if unreachable:
            broken_on.healthy = False  # health checks bring it back once it answers
        turn = migration.continuation()
        if turn is None:
            context.metrics.migrations_by["impossible"].inc()
            return False
        logger.warning(
            "decode's stream broke off on %s (%s) after %s: continuing on another engine",
            broken_on.url, why, migration.ledger.progress,
        )  # fmt: skip
        if self.continued is not None:
            await self.continued.aclose()
            self.continued = None
        else:
            await self.upstream.aclose()
        try:
            reply = await migration.resume(turn, broken_on)
        except GatewayError as error:
            logger.warning("the reply could not continue: %s", error)
            context.metrics.migrations_by["failed"].inc()
            return False
        if reply.stream is None or reply.status != 200:
            context.metrics.migrations_by["failed"].inc()
            return False
        context.metrics.migrations_by["continued"].inc()
        self.continued = reply.stream
        self.continued_on = getattr(reply.stream, "instance", None)
        return True

    async def abandon(self) -> None:
        """Close it unsent: the turn is served another way, and counted there."""
        self.first = False
        self.broken = True
        await self.aclose()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.hangs is not None:
            self.hangs.close()
        completed = (self.upstream.at_end or self.done) and not self.broken
        if self.continued is not None:
            completed = False  # decode's own stream broke: it keeps nothing of the turn
            await self.continued.aclose()
        await self.upstream.aclose()
        self.instance.in_flight -= 1
        if self.spans is not None:
            self.spans.end(200 if completed else None)
        if self.first:
            # Closed before any chunk: decode took the turn all the same.
            self.settlement.count(self.prefilled, self.instance)
        if not completed:
            self.after.holder = None
            self.after.incomplete = True
        elif self.collector is not None:
            self.after.reply = self.collector.message()
        self.settlement.settle_later(self.after)


async def cancel_reply(decoding: asyncio.Future[Reply]) -> None:
    """Call off a decode request whose reply the client will never see (its turn is served
    another way, or not at all): vLLM aborts a request whose connection closes."""
    decoding.cancel()
    await asyncio.gather(decoding, return_exceptions=True)
    if not decoding.cancelled() and decoding.exception() is None:
        reply = decoding.result()
        if isinstance(reply.stream, Relay):
            await reply.stream.abandon()


def streamed(decoding: asyncio.Future[Reply]) -> bool:
    return decoding.result().stream is not None
