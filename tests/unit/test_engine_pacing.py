"""The worker's spin window: capped while the engine is idle, upstream's while it generates
(a window capped between decode steps cost 5 s stalls and slower streams; see
``cap_worker_spin_window``). Against a stand-in for vLLM's ``SpinCondition``."""

from __future__ import annotations

import sys
import types

import pytest

from kvturn.connector import engine_pacing


class _SpinCondition:
    """vLLM's reader side, as far as the patch reads it: ``busy_loop_s`` and ``last_read``."""

    def __init__(self) -> None:
        self.busy_loop_s = 1.0
        self.last_read = 0.0
        self.windows: list[float] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.windows.append(self.busy_loop_s)


@pytest.fixture
def condition(monkeypatch: pytest.MonkeyPatch) -> _SpinCondition:
    module = types.ModuleType("vllm.distributed.device_communicators.shm_broadcast")
    module.SpinCondition = _SpinCondition  # type: ignore[attr-defined]
    package = types.ModuleType("vllm.distributed.device_communicators")
    package.shm_broadcast = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators", package)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert engine_pacing.cap_worker_spin_window(0.002)
    return _SpinCondition()


def test_generating_keeps_upstreams_window_and_idle_gets_the_cap(
    condition: _SpinCondition,
) -> None:
    # Reads 7 ms apart (decode steps of the tiny model): upstream's 1 s window.
    for step in range(1, 6):
        condition.last_read = 100 + step * 0.007
        condition.wait(5000)
    assert condition.windows[-1] == 1.0
    # A read 250 ms after the last (a paced idle step): the cap, so the worker sleeps.
    condition.last_read += 0.25
    condition.wait(5000)
    assert condition.windows[-1] == 0.002
    # Waiting again with no read between: still idle.
    condition.wait(5000)
    assert condition.windows[-1] == 0.002
    # Generation resumes: the window comes back.
    condition.last_read += 0.007
    condition.wait(5000)
    assert condition.windows[-1] == 1.0
