"""The pause clock, driven by a fake clock."""

from __future__ import annotations

from kvturn.client import Pause
from kvturn.client._pauses import PauseTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_first_request_has_no_pause() -> None:
    tracker = PauseTracker(FakeClock())
    assert tracker.begin_request() is None
    assert tracker.in_flight == 1


def test_pause_runs_from_reply_end_to_next_request() -> None:
    clock = FakeClock()
    tracker = PauseTracker(clock)
    tracker.begin_request()
    clock.advance(5.0)  # generation time is not pause
    assert tracker.end_reply(tool_calls=False) == clock.now
    clock.advance(1.234)
    assert tracker.current() == Pause(ms=1234, kind="user")
    assert tracker.begin_request() == Pause(ms=1234, kind="user")
    assert tracker.current() is None


def test_tool_calls_make_a_tool_pause_and_the_kind_resets() -> None:
    clock = FakeClock()
    tracker = PauseTracker(clock)
    tracker.begin_request()
    tracker.end_reply(tool_calls=True)
    clock.advance(0.5)
    assert tracker.begin_request() == Pause(ms=500, kind="tool")
    tracker.end_reply(tool_calls=False)
    clock.advance(0.25)
    assert tracker.begin_request() == Pause(ms=250, kind="user")


def test_adapter_tool_start_marks_a_tool_pause() -> None:
    clock = FakeClock()
    tracker = PauseTracker(clock)
    tracker.begin_request()
    tracker.end_reply(tool_calls=False)
    tracker.note_tool_started()
    clock.advance(0.1)
    assert tracker.begin_request() == Pause(ms=100, kind="tool")


def test_parallel_requests_pause_only_when_nothing_is_in_flight() -> None:
    clock = FakeClock()
    tracker = PauseTracker(clock)
    tracker.begin_request()
    assert tracker.begin_request() is None  # parallel to the first
    clock.advance(1.0)
    # One reply ends while the other is in flight: not idle, no heartbeat pause yet.
    assert tracker.end_reply(tool_calls=True) is None
    assert tracker.current() is None
    clock.advance(1.0)
    assert tracker.end_reply(tool_calls=False) == clock.now
    clock.advance(0.3)
    # Measured from the last reply; tool because one of the replies asked for tools.
    assert tracker.begin_request() == Pause(ms=300, kind="tool")


def test_request_started_before_the_other_reply_ends_is_not_paused_twice() -> None:
    clock = FakeClock()
    tracker = PauseTracker(clock)
    tracker.begin_request()
    tracker.begin_request()
    tracker.end_reply(tool_calls=True)  # A ends; B still in flight
    clock.advance(0.2)
    assert tracker.begin_request() == Pause(ms=200, kind="tool")  # C after A's tool ran
    assert tracker.begin_request() is None  # D parallel to C: no new reply ended
