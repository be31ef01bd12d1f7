"""How late the gateway's event loop runs, and the batch prompts that wait for it to catch up.

One gateway process relays every engine request on one event loop. A batch of prompts is many
engine requests (a window of :data:`~.batches.BATCH_WINDOW` each), and engines answer small
requests faster than one process relays them: measured (``benchmarks/isolation.py``), four
tenant-B batches of 256 one-line prompts against an engine that answers at once took tenant
A's paced turns from 200 a second (p99 8 ms) to 85 a second (p99 80 ms), every one of A's steps
queued behind B's. The per-tenant limits bound how much a tenant holds, not how fast its
holdings turn over.

:class:`LoopLag` measures how late the loop wakes a timer and how busy the process is.
:class:`BulkLane` is the number of batch prompts the whole gateway runs at once, every batch of
every tenant together: halved each time the loop is found behind while prompts run and turns
are under way, grown by 1/limit each
sample otherwise while prompts wait (additive increase, multiplicative decrease, as TCP paces a
sender), never under one. Batches yield the loop to everyone's turns and still progress; with
no turn to yield to, a batch alone keeps its width (on a machine the engines share, their own
work makes the loop late: a lane that narrowed anyway took a 64-prompt batch alone to the tiny
model's pair from 0.7-0.9 s to 1.9 s).

Measured on 2 cores (four batches of 256 against A's 200 paced turns a second; A's p99 over its
p99 alone): each batch held to one prompt while the loop ran 2 ms late, 5.8x (each batch still
ran one prompt, and every sample on time opened every window at once: bursts of 4 x 32); one
lane, 2 ms, one more place each on-time sample, 4.2x (the lane settled near 20 places); late
from 0.5 ms, 2.7x (near 10); growing by 1/limit, 2.6x (near 4). The lane then still moved
between 4 and 10 places: 9% of its samples found the loop late, while the process used 0.8 of
a core and A's p99 doubled. A timer's lateness at one instant misses most of the queueing a
turn meets on a busy loop, so the loop also counts as behind while the process's own CPU time,
averaged over the last ~25 ms, exceeds half its wall time (:data:`BUSY_MAX`): the same
attacker, six seconds twice, measured with it run under ``SCHED_IDLE`` (as if on a machine of
its own), 1.75-1.97x with lateness alone; 0.59-1.35x with both, the gateway at 0.57 of a core
and B still served 1,300-1,500 prompts a second.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

#: How often the loop's lateness is sampled (seconds).
SAMPLE_S = 0.005
#: A loop this late (seconds) is behind: each of a turn's few steps waits about this long,
#: and a turn alone takes 2-3 ms through the gateway here.
LATE_S = 0.0005
#: Batch prompts the gateway runs at once with the loop on time: four whole windows.
LANE_CEILING = 128
#: A gateway process this busy (CPU seconds a second, the process's own: the engines' work on
#: a shared machine does not count) is behind, late loop or not: its loop's timer samples miss
#: most of what queues a turn's steps (below).
BUSY_MAX = 0.5
#: Weight of each sample in the running mean of ``busy`` (about the last 25 ms).
BUSY_WEIGHT = 0.2


class LoopLag:
    """The event loop's lateness and the process's busyness, sampled by :meth:`watch` (a task
    of the gateway's)."""

    def __init__(
        self,
        sample_s: float = SAMPLE_S,
        late_s: float = LATE_S,
        cpu_clock: Callable[[], float] = time.process_time,
    ):
        self.sample_s = sample_s
        self.late_s = late_s
        #: The process's CPU seconds so far.
        self.cpu_clock = cpu_clock
        #: How late the last sample's timer fired (seconds); 0 until one has.
        self.lag_s = 0.0
        #: The process's CPU time per second of the loop's, averaged over recent samples.
        self.busy = 0.0

    async def watch(self, lane: BulkLane | None = None) -> None:
        """Sample for good; each sample adjusts ``lane``."""
        loop = asyncio.get_running_loop()
        cpu = self.cpu_clock()
        while True:
            started = loop.time()
            await asyncio.sleep(self.sample_s)
            now = loop.time()
            self.lag_s = max(0.0, now - started - self.sample_s)
            cpu, used = self.cpu_clock(), cpu
            self.busy += BUSY_WEIGHT * ((cpu - used) / max(now - started, 1e-6) - self.busy)
            if lane is not None:
                lane.sampled(self.behind)

    @property
    def late(self) -> bool:
        return self.lag_s > self.late_s

    @property
    def behind(self) -> bool:
        """Late, or busier than :data:`BUSY_MAX`."""
        return self.late or self.busy > BUSY_MAX


class BulkLane:
    """Batch prompts under way at once, gateway-wide, within a limit that the loop's samples
    set (:meth:`sampled`). A prompt waits its turn in :meth:`acquire`, first come first served
    across batches and tenants."""

    def __init__(self, ceiling: int = LANE_CEILING, contended: Callable[[], bool] = lambda: True):
        self.ceiling = ceiling
        #: Whether other work than batches is under way (turns in flight): only then is
        #: there anyone to yield to.
        self.contended = contended
        self._limit = float(ceiling)
        #: Prompts running now (over ``limit`` for a while after a late sample).
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    def sampled(self, late: bool) -> None:
        """A sample of the loop (``late``: :attr:`LoopLag.behind`): late with prompts running
        while turns are under way halves the limit; else, with prompts waiting, it adds
        1/limit (one a limit's worth of samples, as TCP's window)."""
        if late and self.running and self.contended():
            self._limit = max(1.0, self._limit / 2)
        elif self._waiting and self._limit < self.ceiling:
            self._limit = min(float(self.ceiling), self._limit + 1 / self._limit)
            self._wake()

    @property
    def limit(self) -> int:
        """Prompts let run at once now."""
        return int(self._limit)

    async def acquire(self) -> None:
        """A place, once the prompts ahead have theirs and the limit leaves one (give it
        back with :meth:`release`)."""
        if self.running < self.limit and not self._waiting:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                if turn in self._waiting:
                    self._waiting.remove(turn)
            else:
                self.release()  # given a place as it was called off: pass it on
            raise

    def release(self) -> None:
        """A prompt's place given back: the next waiting prompts get theirs."""
        self.running -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self.running < self.limit:
            turn = self._waiting.popleft()
            if turn.done():
                continue  # called off while it waited
            self.running += 1
            turn.set_result(None)
