"""Heartbeats: renew a paused conversation's lease until its next request.

:class:`HeartbeatSchedule` is plain bookkeeping driven by an explicit ``now`` (deterministic in
tests). :class:`HeartbeatThread` (sync clients) and :class:`HeartbeatTask` (async clients) are
the one background worker per client that sleeps until the next deadline and sends the beats.
A beat function never raises into the worker; it returns the next interval, or ``None`` to stop
beating that conversation for the rest of the pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ._clock import Clock
from ._settings import KvturnSettings

__all__ = ["HeartbeatSchedule", "HeartbeatTask", "HeartbeatThread", "ScheduledBeat"]

log = logging.getLogger("kvturn.client")

SyncBeat = Callable[["ScheduledBeat"], "float | None"]
AsyncBeat = Callable[["ScheduledBeat"], Awaitable["float | None"]]


@dataclass(slots=True, eq=False)
class ScheduledBeat:
    """The heartbeat plan of one paused conversation."""

    conversation_id: str
    paused_at: float
    next_at: float
    stop_at: float
    interval: float
    sent: int = 0


class HeartbeatSchedule:
    """Which paused conversations need a beat when. Thread-safe."""

    def __init__(self, settings: KvturnSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._entries: dict[str, ScheduledBeat] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._entries

    def start(
        self, conversation_id: str, *, paused_at: float, lease_seconds: float
    ) -> float | None:
        """Plan beats for a pause that began at ``paused_at``: when the first is due, or
        ``None`` if none fits before the maximum pause."""
        interval = max(lease_seconds / 2, self._settings.min_heartbeat_interval_seconds)
        entry = ScheduledBeat(
            conversation_id=conversation_id,
            paused_at=paused_at,
            # Half the lease: one lost beat still leaves time for the next before expiry.
            next_at=paused_at + interval,
            stop_at=paused_at + self._settings.max_pause_seconds,
            interval=interval,
        )
        with self._lock:
            if entry.next_at >= entry.stop_at:
                self._entries.pop(conversation_id, None)
                return None
            self._entries[conversation_id] = entry
            return entry.next_at

    def stop(self, conversation_id: str) -> None:
        """No more beats for this conversation (a request started, or it was left)."""
        with self._lock:
            self._entries.pop(conversation_id, None)

    def clear(self) -> None:
        """Forget every plan (the client is closing, or the gateway refused heartbeats)."""
        with self._lock:
            self._entries.clear()

    def next_deadline(self) -> float | None:
        """When the earliest planned beat is due; ``None`` when nothing is planned."""
        with self._lock:
            deadline = min((e.next_at for e in self._entries.values()), default=None)
        # Beats being sent right now sit at +inf until rescheduled.
        return None if deadline is None or math.isinf(deadline) else deadline

    def take_due(self, now: float) -> list[ScheduledBeat]:
        """The beats due at ``now``; drops plans whose pause outgrew the maximum."""
        due: list[ScheduledBeat] = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if now >= entry.stop_at:
                    log.debug("kvturn: conversation %s paused past the maximum; beats stop", key)
                    del self._entries[key]
                elif entry.next_at <= now:
                    entry.next_at = math.inf
                    due.append(entry)
        return due

    def reschedule(self, entry: ScheduledBeat, *, now: float, interval: float | None) -> None:
        """After a beat: plan the next one, or drop the plan when ``interval`` is ``None``."""
        with self._lock:
            # The plan may have been replaced meanwhile (a request started and a new pause
            # began while the beat was on the wire); never clobber the newer one.
            if self._entries.get(entry.conversation_id) is not entry:
                return
            entry.sent += 1
            if interval is None:
                del self._entries[entry.conversation_id]
                return
            entry.interval = max(interval, self._settings.min_heartbeat_interval_seconds)
            entry.next_at = now + entry.interval
            if entry.next_at >= entry.stop_at:
                del self._entries[entry.conversation_id]


def _safe_interval(entry: ScheduledBeat, result: float | None) -> float | None:
    return result if result is None or result > 0 else entry.interval


class HeartbeatThread:
    """The sync client's single beat worker: a daemon thread started on first use."""

    def __init__(self, schedule: HeartbeatSchedule, beat: SyncBeat, clock: Clock) -> None:
        self._schedule = schedule
        self._beat = beat
        self._clock = clock
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # When the worker will look at the schedule next on its own (-inf while it is busy).
        self._sleep_until = -math.inf

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def wake(self, deadline: float | None = None) -> None:
        """The schedule changed: start the worker if needed and let it recompute its sleep.

        A ``deadline`` no earlier than the worker's own wake-up needs no nudge: in steady state
        (a beat planned every request, 15 s out) the worker is not woken per request.
        """
        if self._closed:
            return
        # Sleeping until no later than ``deadline`` (not busy: -inf), the worker will see the
        # change by itself in time.
        until = self._sleep_until
        if deadline is not None and until != -math.inf and deadline >= until:
            return
        if not self.running:
            with self._start_lock:
                if not self.running and not self._closed:
                    self._thread = threading.Thread(
                        target=self._run, name="kvturn-heartbeats", daemon=True
                    )
                    self._thread.start()
        self._wake.set()

    def close(self, timeout: float | None = 1.0) -> None:
        """Stop the worker; an in-flight beat may finish first."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def run_due(self) -> None:
        """Send every beat due now and plan the next ones (the worker's step)."""
        for entry in self._schedule.take_due(self._clock()):
            try:
                result = _safe_interval(entry, self._beat(entry))
            except Exception:  # a bug in a beat must not kill the worker
                log.exception("kvturn: heartbeat for %s failed", entry.conversation_id)
                result = entry.interval
            self._schedule.reschedule(entry, now=self._clock(), interval=result)

    def _run(self) -> None:
        while not self._closed:
            # Busy first, then clear, then read the schedule: a change after this point sets
            # the event again and the wait below returns at once, so no wake-up is lost.
            self._sleep_until = -math.inf
            self._wake.clear()
            deadline = self._schedule.next_deadline()
            if deadline is None:
                self._sleep_until = math.inf
                self._wake.wait()
                continue
            delay = deadline - self._clock()
            if delay > 0:
                self._sleep_until = deadline
                self._wake.wait(delay)
                continue
            self.run_due()


class HeartbeatTask:
    """The async client's single beat worker: one task on the loop the client is used from."""

    def __init__(self, schedule: HeartbeatSchedule, beat: AsyncBeat, clock: Clock) -> None:
        self._schedule = schedule
        self._beat = beat
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._sleep_until = -math.inf

    @property
    def running(self) -> bool:
        """Whether the worker task is alive."""
        return self._task is not None and not self._task.done()

    def wake(self, deadline: float | None = None) -> None:
        """The schedule changed: start the worker on the running loop if needed, and nudge it
        unless ``deadline`` is no earlier than its own wake-up."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        # Sleeping (on this loop) until no later than ``deadline``, the worker will see the
        # change by itself in time.
        until = self._sleep_until
        if (
            deadline is not None
            and until != -math.inf
            and deadline >= until
            and (loop is None or loop is self._loop)
        ):
            return
        if loop is not None and (not self.running or self._loop is not loop):
            if self._task is not None and self._loop is not loop and not self._task.done():
                # The client moved to another loop (common across test cases); the old task
                # dies with its loop, the schedule carries over.
                self._task.cancel()
            self._loop = loop
            self._sleep_until = -math.inf
            self._wake = asyncio.Event()
            # An empty context: the worker must not inherit the caller's current conversation.
            self._task = loop.create_task(self._run(), context=contextvars.Context())
        if self._wake is None or self._loop is None:
            return
        if loop is self._loop:
            self._wake.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def aclose(self) -> None:
        """Stop the worker task."""
        self._closed = True
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        if self._loop is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run_due(self) -> None:
        """Send every beat due now, concurrently, and plan the next ones."""
        entries = self._schedule.take_due(self._clock())
        if not entries:
            return
        results = await asyncio.gather(*(self._beat(e) for e in entries), return_exceptions=True)
        now = self._clock()
        for entry, result in zip(entries, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.error("kvturn: heartbeat for %s failed: %r", entry.conversation_id, result)
                interval: float | None = entry.interval
            else:
                interval = _safe_interval(entry, result)
            self._schedule.reschedule(entry, now=now, interval=interval)

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while not self._closed:
            self._sleep_until = -math.inf
            wake.clear()
            deadline = self._schedule.next_deadline()
            if deadline is None:
                self._sleep_until = math.inf
                await wake.wait()
                continue
            delay = deadline - self._clock()
            if delay > 0:
                self._sleep_until = deadline
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), delay)
                continue
            await self.run_due()
