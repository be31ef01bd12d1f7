"""Pace an engine that has nothing to run but still holds retained KV blocks.

While a finished request's blocks wait to be read (bidirectional mode) or to expire, vLLM's
engine core keeps stepping to poll the connector, and the worker busy-spins (``sched_yield``)
for up to 1 s after every message it reads. An idle decode holding a conversation's KV then
burns a whole core. kvturn paces the empty steps (:class:`IdlePacer`, called from
``KvturnConnector.build_connector_meta``) and caps the worker's spin window while the engine
is idle, so between paced steps the worker sleeps on its socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SPIN_WINDOW_S = 0.002
#: Reads this close together are an engine generating: the reader keeps upstream's window.
ACTIVE_READ_GAP_S = 0.05


def cap_worker_spin_window(max_s: float = DEFAULT_SPIN_WINDOW_S) -> bool:
    """Limit how long a shared-memory queue reader spins before it sleeps while the engine is
    idle (its reads further than :data:`ACTIVE_READ_GAP_S` apart); whether patched.

    Only while idle: measured here (tiny model, 1,500-token greedy streams through the test
    pair), a window capped at 2 ms all the time made the worker park on its socket between
    decode steps (~7 ms apart): streams took 7.8-12.7 s, one in four with a 5.0 s stall
    (vLLM's ``SHM_READER_RECHECK_INTERVAL_MS``, its recovery from a lost wake-up), against
    6.3-7.6 s and no stall with upstream's window. Between steps of a generating engine the
    reader now spins as upstream's does."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not hasattr(condition, "wait"):
        return False
    original = getattr(condition, "_kvturn_original_wait", None) or condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        upstream_s = getattr(self, "_kvturn_upstream_busy_s", None)
        if upstream_s is None:
            upstream_s = self._kvturn_upstream_busy_s = getattr(self, "busy_loop_s", 0)
            self._kvturn_seen_read = self._kvturn_read_gap = 0.0
        last_read = getattr(self, "last_read", 0.0)
        if last_read != self._kvturn_seen_read:  # a read since the last wait: how far apart?
            self._kvturn_read_gap = last_read - self._kvturn_seen_read
            self._kvturn_seen_read = last_read
        active = self._kvturn_read_gap < ACTIVE_READ_GAP_S
        self.busy_loop_s = upstream_s if active else min(upstream_s, max_s)
        original(self, timeout_ms)

    condition._kvturn_original_wait = original
    condition.wait = wait
    logger.info("kvturn: shared-memory reader spin window capped at %.1f ms", max_s * 1000)
    return True


class IdlePacer:
    """How long an empty engine step waits before the next one.

    Short (``short_s``) during the first ``short_phase_s`` of idleness, so a request that
    arrives soon after another is picked up at once; long (``long_s``) after that, so that an
    idle engine holding leases costs next to no CPU (each empty step wakes the engine core and
    its worker: a couple of milliseconds of CPU). :meth:`wake` ends a wait early and restarts
    the short phase: the gateway calls it (through the control server) when a turn is on its
    way to this engine, and every lease call does.

    :meth:`expect` says more: a request will reach the engine within ``within_s`` (a
    ``decode-local`` turn, sent the moment it is planned). A wake alone would end the current
    wait only for the engine to begin another ``short_s`` one, which the request, a few
    milliseconds behind (the API server renders and tokenizes it first), then sits out. So
    until the request arrives (the engine gets busy) or ``within_s`` passes, empty steps are
    ``soon_s`` apart.

    ``loading``: a request waits on KV that this engine is reading over NIXL (a prefill pulling
    a conversation from its holder, a decode reading prefill's answer). Only a step sees the
    read land, and the request schedules no tokens until then, so its steps are empty. Paced as
    idle, the step that handed the worker the read waited before the read began, and each step
    after it too. Measured (``benchmarks/pull_after_pause.py``: 4k-token history, 250 new
    tokens, prefill without a prefix cache): a pull-reuse turn's TTFT was 371 ms (354-386)
    after a 3 s pause and 124 ms after 0.3 s; with the step that starts a read unpaced and the
    steps while it is in flight ``soon_s`` apart (upstream's own loop spaces them 1 ms), 99 ms
    and 103 ms.
    """

    def __init__(
        self,
        short_s: float = 0.01,
        long_s: float = 0.25,
        short_phase_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        soon_s: float = 0.001,
    ):
        self.short_s = short_s
        self.long_s = long_s
        self.short_phase_s = short_phase_s
        self.soon_s = soon_s
        self._clock = clock
        self._idle_since: float | None = None
        self._expected_until = 0.0
        self._woken = threading.Event()

    def next_wait(self, busy: bool, expecting: bool = False, loading: bool = False) -> float:
        """Seconds the step should wait (0 when it scheduled work; short while ``expecting``
        work that no request brings, such as KV a prefill pushes, which only a step sees;
        ``soon_s`` while ``loading``: a read of KV this engine started is in flight)."""
        if busy:
            self._idle_since = None
            self._expected_until = 0.0
            return 0.0
        now = self._clock()
        if loading or now < self._expected_until:
            return self.soon_s
        if self._idle_since is None:
            self._idle_since = now
        if expecting or now - self._idle_since < self.short_phase_s:
            return self.short_s
        return self.long_s

    def pace(self, busy: bool, expecting: bool = False, loading: bool = False) -> None:
        wait_s = self.next_wait(busy, expecting, loading)
        if wait_s > 0:
            self._woken.wait(wait_s)
            self._woken.clear()

    def wake(self) -> None:
        self._idle_since = None
        self._woken.set()

    def expect(self, within_s: float) -> None:
        """A request reaches the engine within ``within_s``: step often until it does."""
        self._expected_until = self._clock() + max(0.0, min(within_s, 1.0))
        self.wake()
