"""The clock that pause tracking and heartbeat scheduling read, injectable for tests."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "monotonic_clock"]


class Clock(Protocol):
    """Anything that returns monotonic seconds; ``time.monotonic`` is the default."""

    def __call__(self) -> float: ...


# Wall-clock time can jump (NTP, suspend); pauses and deadlines must not.
monotonic_clock: Clock = time.monotonic
