"""The one background heartbeat worker a client has: :class:`HeartbeatThread` (sync clients)
and :class:`HeartbeatTask` (async clients) sleep until the schedule's next deadline
(``_heartbeats.py``) and send the beats. A beat function never raises into the worker; it
returns the next interval, or ``None`` to stop beating that conversation for the rest of the
pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
from collections.abc import Awaitable, Callable

from ._clock import Clock
from ._heartbeats import HeartbeatSchedule, ScheduledBeat

__all__ = ["HeartbeatTask", "HeartbeatThread"]

log = logging.getLogger("kvturn.client")

SyncBeat = Callable[[ScheduledBeat], "float | None"]
AsyncBeat = Callable[[ScheduledBeat], Awaitable["float | None"]]


def _safe_interval(entry: ScheduledBeat, result: float | None) -> float | None:
    return result if result is None or result > 0 else entry.interval


class HeartbeatThread:
    """The sync client's single beat worker: a daemon thread started on first use."""

    #: Started once and alive until closed: a pause its plan covers needs no nudge.
    wake_each_pause = False

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

    #: Its loop may have ended (the client is used from another now): every pause checks.
    wake_each_pause = True

    def __init__(self, schedule: HeartbeatSchedule, beat: AsyncBeat, clock: Clock) -> None:
        self._schedule = schedule
        self._beat = beat
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._sleep_until = -math.inf
        # Woken on its loop and not yet awake: later wake() calls there need do nothing.
        self._nudged = False
        #: The loop it is running on (None until it first runs, and once it has stopped).
        self.live_loop: asyncio.AbstractEventLoop | None = None

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
        if loop is None or loop is self._loop:
            # Sleeping (on this loop) until no later than ``deadline``, the worker will see the
            # change by itself in time; nudged and not yet awake, it will look anyway.
            until = self._sleep_until
            if deadline is not None and until != -math.inf and deadline >= until:
                return
            if self._nudged and loop is not None and self.running:
                return
        if loop is not None and (not self.running or self._loop is not loop):
            if self._task is not None and self._loop is not loop and not self._task.done():
                # The client moved to another loop (common across test cases); the old task
                # dies with its loop, the schedule carries over.
                self._task.cancel()
            self._loop = loop
            self._sleep_until = -math.inf
            self._nudged = False
            self._wake = asyncio.Event()
            # An empty context: the worker must not inherit the caller's current conversation.
            self._task = loop.create_task(self._run(), context=contextvars.Context())
        if self._wake is None or self._loop is None:
            return
        if loop is self._loop:
            self._nudged = True
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
        self.live_loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                self._sleep_until = -math.inf
                wake.clear()
                self._nudged = False
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
        finally:
            if self._wake is wake:  # not replaced by a task on another loop
                # Gone (cancelled, closed): the next wake() restarts it.
                self._sleep_until = -math.inf
                self._nudged = False
                self.live_loop = None
