"""How late the gateway's event loop runs, and the work that waits for it to catch up.

One gateway process relays every engine request on one event loop. A batch of prompts is many
engine requests at once (a window of :data:`~.batches.BATCH_WINDOW` each), and engines answer
small requests faster than one process relays them: measured (``benchmarks/isolation.py``),
four tenant-B batches of 256 one-line prompts against an engine that answers at once took
tenant A's paced turns from 200 a second (p99 8 ms) to 85 a second (p99 80 ms), every one of
A's steps queued behind B's. The per-tenant limits bound how much a tenant holds, not how fast
its holdings turn over.

:class:`LoopLag` measures how late the loop wakes a timer. While it runs late, a batch starts
no further prompt as long as one of its own is under way: each batch keeps going, one prompt
at a time, and the loop's time goes to every caller's work in turn rather than to the batches'
windows. With the loop on time, batches use their whole window. Waiting prompts poll
nothing: they queue on their batch's lock (or, streamed, on its last prompt's reply).
"""

from __future__ import annotations

import asyncio

#: How often the loop's lateness is sampled (seconds).
SAMPLE_S = 0.005
#: A loop this late (seconds) is behind: a turn's few steps each wait about this long.
LATE_S = 0.002


class LoopLag:
    """The event loop's lateness, sampled by :meth:`watch` (a task of the gateway's)."""

    def __init__(self, sample_s: float = SAMPLE_S, late_s: float = LATE_S):
        self.sample_s = sample_s
        self.late_s = late_s
        #: How late the last sample's timer fired (seconds); 0 until one has.
        self.lag_s = 0.0

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.sample_s)
            self.lag_s = max(0.0, loop.time() - started - self.sample_s)

    @property
    def late(self) -> bool:
        return self.lag_s > self.late_s
