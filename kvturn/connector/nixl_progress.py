"""Keep NIXL's progress thread from spinning a whole core.

NIXL's Python API (``nixl_agent.__init__``) hard-codes ``pthrDelay = 0`` for the agent's progress
thread, so every agent busy-polls one core. On a small CPU machine a prefill and a decode engine
then starve each other (an 8k prefill took 16 to 44 s instead of ~2 s here). Turning the progress
thread off hangs transfers, so instead we raise its delay: the binding's config class is replaced
by a subclass that never lets ``pthrDelay`` drop below a floor.

This runs inside the engine processes only (the kvturn connector module applies it on import).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Default floor for the progress thread's delay, in microseconds (1 ms).
DEFAULT_PROGRESS_DELAY_US = 1000

_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def raise_progress_thread_delay(delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> bool:
    """Make every NIXL agent created from now on use ``pthrDelay >= delay_us``.

    Returns whether a NIXL binding was found and patched. Idempotent: a second call only
    updates the floor.
    """
    patched = False
    for name in _BACKENDS:
        try:
            bindings: Any = importlib.import_module(f"{name}._bindings")
        except ImportError:
            continue
        original = getattr(bindings, "_kvturn_original_config", None) or bindings.nixlAgentConfig
        floor = int(delay_us)

        class _DelayedProgressConfig(original):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any, _floor: int = floor) -> None:
                if key == "pthrDelay":
                    value = max(int(value), _floor)
                super().__setattr__(key, value)

        bindings._kvturn_original_config = original
        bindings.nixlAgentConfig = _DelayedProgressConfig
        patched = True
        logger.info("kvturn: NIXL progress-thread delay floor set to %d us (%s)", floor, name)
    return patched
