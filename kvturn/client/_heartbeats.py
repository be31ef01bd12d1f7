"""Heartbeats: renew a paused conversation's lease until its next request.

:class:`HeartbeatSchedule` is plain bookkeeping driven by an explicit ``now`` (deterministic in
tests); the worker that sleeps until its next deadline and sends the beats is in
``_heartbeat_workers.py``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ._settings import KvturnSettings

__all__ = ["HeartbeatSchedule", "ScheduledBeat", "Worker"]

log = logging.getLogger("kvturn.client")


class Worker(Protocol):
    """The heartbeat worker: a thread (sync) or a task (async)."""

    #: Whether it must hear of every pause, even one its plan already covers (a task must
    #: check that it still runs on the caller's loop).
    wake_each_pause: bool

    def wake(self, deadline: float | None = None) -> None: ...


@dataclass(slots=True, eq=False)
class ScheduledBeat:
    """The heartbeat plan of one paused conversation."""

    conversation_id: str
    paused_at: float
    next_at: float
    stop_at: float
    interval: float
    sent: int = 0


#: Where a conversation's pause began and its lease length (``None`` while it is not paused).
PauseOf = Callable[[str], "tuple[float, float] | None"]


class HeartbeatSchedule:
    """Which paused conversations need a beat when. Thread-safe.

    With ``pause_of`` the schedule plans lazily: a pause that begins while its conversation's
    plan already has a beat due no later than this pause needs leaves the plan as it is (no
    lock taken: in steady state every reply ends a pause), and :meth:`take_due` re-plans from
    the latest pause's start when that beat comes due.
    """

    def __init__(self, settings: KvturnSettings, pause_of: PauseOf | None = None) -> None:
        self._settings = settings
        self._pause_of = pause_of
        # Re-entrant: an allocation under it may run the garbage collector, whose finalizers
        # (an abandoned stream ending its turn) can plan beats on the same thread.
        self._lock = threading.RLock()
        self._entries: dict[str, ScheduledBeat] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._entries

    def _interval(self, lease_seconds: float) -> float:
        # Half the lease: one lost beat still leaves time for the next before expiry.
        interval = lease_seconds / 2
        floor = self._settings.min_heartbeat_interval_seconds
        return interval if interval > floor else floor

    def pause_began(
        self, conversation_id: str, paused_at: float, lease_seconds: float
    ) -> ScheduledBeat | None:
        """A pause began: see that its beats are planned. Returns the conversation's plan
        (whose ``next_at`` is when its next beat is due), or ``None`` if no beat fits before
        the maximum pause."""
        if self._pause_of is not None:
            # A plain read (dict.get is atomic): the worker may be re-planning this entry or
            # sending its beat (next_at is then +inf, and the comparison fails).
            entry = self._entries.get(conversation_id)
            if entry is not None and entry.next_at <= paused_at + self._interval(lease_seconds):
                return entry
        return self._plan(conversation_id, paused_at, lease_seconds)

    def start(
        self, conversation_id: str, *, paused_at: float, lease_seconds: float
    ) -> float | None:
        """Plan beats for a pause that began at ``paused_at``: when the first is due, or
        ``None`` if none fits before the maximum pause."""
        entry = self._plan(conversation_id, paused_at, lease_seconds)
        return None if entry is None else entry.next_at

    def _plan(
        self, conversation_id: str, paused_at: float, lease_seconds: float
    ) -> ScheduledBeat | None:
        interval = self._interval(lease_seconds)
        next_at = paused_at + interval
        stop_at = paused_at + self._settings.max_pause_seconds
        entries = self._entries
        if next_at >= stop_at:
            self.stop(conversation_id)
            return None
        with self._lock:
            entry = entries.get(conversation_id)
            # Reuse the conversation's plan object, unless its beat is on the wire (next_at is
            # +inf), whose rescheduling must then find a new object and leave it alone.
            if entry is not None and entry.next_at != math.inf:
                entry.paused_at = paused_at
                entry.next_at = next_at
                entry.stop_at = stop_at
                entry.interval = interval
                entry.sent = 0
                return entry
            current = entry
            entry = ScheduledBeat(conversation_id, paused_at, next_at, stop_at, interval)
            if current is not None and current.paused_at > paused_at:
                return current  # a later pause was planned meanwhile: it stands
            entries[conversation_id] = entry
            return entry

    def _drop(self, conversation_id: str) -> None:
        # Under the lock. A dropped plan reads as due never (+inf), for whoever holds it.
        entry = self._entries.pop(conversation_id, None)
        if entry is not None:
            entry.next_at = math.inf

    def stop(self, conversation_id: str) -> None:
        """No more beats for this conversation (a request started, or it was left)."""
        with self._lock:
            self._drop(conversation_id)

    def clear(self) -> None:
        """Forget every plan (the client is closing, or the gateway refused heartbeats)."""
        with self._lock:
            for entry in self._entries.values():
                entry.next_at = math.inf
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
        late: list[tuple[str, float]] = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.next_at > now and now < entry.stop_at:
                    continue
                if self._pause_of is not None and entry.next_at != math.inf:
                    pause = self._pause_of(key)
                    if pause is not None and pause[0] > entry.paused_at:
                        # A later pause began since this plan was made: plan from its start.
                        paused_at, lease_seconds = pause
                        entry.interval = self._interval(lease_seconds)
                        entry.paused_at = paused_at
                        entry.next_at = paused_at + entry.interval
                        entry.stop_at = paused_at + self._settings.max_pause_seconds
                        entry.sent = 0
                        if entry.next_at >= entry.stop_at:
                            self._drop(key)
                            continue
                        if entry.next_at > now and now < entry.stop_at:
                            continue
                if now >= entry.stop_at:
                    log.debug("kvturn: conversation %s paused past the maximum; beats stop", key)
                    self._drop(key)
                else:
                    if now - entry.next_at >= entry.interval:
                        late.append((key, now - entry.next_at))
                    entry.next_at = math.inf
                    due.append(entry)
        # Beats come at half the lease: one late by the other half comes after the lease ran
        # out, and cannot bring the KV back. Logged outside the lock (a handler may do I/O).
        for key, seconds in late:
            log.warning(
                "kvturn: the heartbeat of conversation %s is %.1f s late, more than the time "
                "between beats: its lease may have run out and its next turn be recomputed. "
                "Was the event loop blocked (run blocking tools in a thread) or the process "
                "stopped?",
                key,
                seconds,
            )
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
                self._drop(entry.conversation_id)
                return
            entry.interval = max(interval, self._settings.min_heartbeat_interval_seconds)
            entry.next_at = now + entry.interval
            if entry.next_at >= entry.stop_at:
                self._drop(entry.conversation_id)
