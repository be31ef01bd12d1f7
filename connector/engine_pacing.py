"""Pace an engine that has nothing to run but still holds retained KV blocks.

While a finished request's blocks wait to be read (bidirectional mode) or to expire, vLLM's
engine core keeps stepping to poll the connector, and the worker busy-spins (``sched_yield``)
for up to 1 s after every message it reads. An idle decode holding a conversation's KV then
burns a whole core. kvturn paces the empty steps (see ``KvturnConnector.build_connector_meta``)
and caps the worker's spin window, so between paced steps the worker sleeps on its socket.
Active generation is unaffected: its steps follow each other well inside the window.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SPIN_WINDOW_S = 0.002


def cap_worker_spin_window(max_s: float = DEFAULT_SPIN_WINDOW_S) -> bool:
    """Limit how long a shared-memory queue reader spins before it sleeps; whether patched."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not hasattr(condition, "wait"):
        return False
    original = getattr(condition, "_kvturn_original_wait", None) or condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "busy_loop_s", 0) > max_s:
            self.busy_loop_s = max_s
        original(self, timeout_ms)

    condition._kvturn_original_wait = original
    condition.wait = wait
    logger.info("kvturn: shared-memory reader spin window capped at %.1f ms", max_s * 1000)
    return True
