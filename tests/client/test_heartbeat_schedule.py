"""Heartbeat planning and the worker step, with an injected clock."""

from __future__ import annotations

import logging
import math

import pytest

from kvturn.client import KvturnSettings
from kvturn.client._heartbeat_workers import HeartbeatThread
from kvturn.client._heartbeats import HeartbeatSchedule, ScheduledBeat


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_beat_at_half_the_lease_then_periodic() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=100))
    assert schedule.start("c", paused_at=10.0, lease_seconds=30.0) == 25.0
    assert schedule.next_deadline() == 25.0
    assert schedule.take_due(24.9) == []
    (entry,) = schedule.take_due(25.0)
    assert entry.conversation_id == "c"
    assert schedule.next_deadline() is None  # in flight: not due again until rescheduled
    schedule.reschedule(entry, now=25.1, interval=15.0)
    assert math.isclose(schedule.next_deadline() or 0, 40.1)
    assert entry.sent == 1


def test_beats_stop_at_the_maximum_pause() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=20))
    schedule.start("c", paused_at=0.0, lease_seconds=20.0)  # beats at 10, then 20 = stop
    (entry,) = schedule.take_due(10.0)
    schedule.reschedule(entry, now=10.0, interval=10.0)
    assert "c" not in schedule
    assert schedule.next_deadline() is None


def test_a_pause_shorter_than_the_maximum_check_drops_overdue_plans() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=5))
    schedule.start("c", paused_at=0.0, lease_seconds=8.0)  # first beat at 4
    assert schedule.take_due(6.0) == []  # past the maximum: dropped, not sent
    assert len(schedule) == 0


def test_no_plan_when_the_first_beat_would_come_after_the_maximum() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=5))
    assert schedule.start("c", paused_at=0.0, lease_seconds=30.0) is None
    assert len(schedule) == 0


def test_reschedule_never_clobbers_a_newer_plan() -> None:
    schedule = HeartbeatSchedule(KvturnSettings())
    schedule.start("c", paused_at=0.0, lease_seconds=2.0)
    (old,) = schedule.take_due(1.0)
    schedule.stop("c")  # a request started while the beat was on the wire...
    schedule.start("c", paused_at=5.0, lease_seconds=2.0)  # ...and a new pause began
    schedule.reschedule(old, now=1.1, interval=1.0)
    assert schedule.next_deadline() == 6.0


def test_interval_has_a_floor() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(min_heartbeat_interval_seconds=0.5))
    schedule.start("c", paused_at=0.0, lease_seconds=0.01)
    assert schedule.next_deadline() == 0.5


def test_worker_step_sends_due_beats_and_follows_their_answers() -> None:
    clock = FakeClock()
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=1000))
    answers = {"a": 7.0, "b": None}
    sent: list[str] = []

    def beat(entry: ScheduledBeat) -> float | None:
        sent.append(entry.conversation_id)
        return answers[entry.conversation_id]

    worker = HeartbeatThread(schedule, beat, clock)
    schedule.start("a", paused_at=0.0, lease_seconds=10.0)
    schedule.start("b", paused_at=0.0, lease_seconds=10.0)
    clock.now = 5.0
    worker.run_due()
    assert sorted(sent) == ["a", "b"]
    assert "b" not in schedule  # None: stop beating b
    assert schedule.next_deadline() == 12.0  # a: the answer's interval


def test_worker_step_survives_a_raising_beat() -> None:
    clock = FakeClock()
    schedule = HeartbeatSchedule(KvturnSettings())
    schedule.start("a", paused_at=0.0, lease_seconds=2.0)

    def beat(entry: ScheduledBeat) -> float | None:
        raise RuntimeError("boom")

    clock.now = 1.0
    HeartbeatThread(schedule, beat, clock).run_due()
    assert schedule.next_deadline() == 2.0  # kept, at the usual interval


def test_a_later_pause_keeps_the_plan_and_is_planned_afresh_when_due() -> None:
    paused: dict[str, tuple[float, float]] = {"c": (0.0, 10.0)}
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=100), paused.get)
    plan = schedule.pause_began("c", 0.0, 10.0)
    assert plan is not None and plan.next_at == 5.0
    # Next reply ends at 3: the beat planned for 5 comes before this pause's (8), so the
    # plan stays as it is...
    paused["c"] = (3.0, 10.0)
    assert schedule.pause_began("c", 3.0, 10.0) is plan and plan.next_at == 5.0
    # ...and when it comes due it is planned from the latest pause instead of being sent.
    assert schedule.take_due(5.0) == []
    assert schedule.next_deadline() == 8.0
    assert schedule.take_due(8.0) == [plan]
    assert (plan.paused_at, plan.stop_at) == (3.0, 103.0)


def test_a_pause_needing_an_earlier_beat_is_planned_at_once() -> None:
    paused: dict[str, tuple[float, float]] = {}
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=100), paused.get)
    schedule.pause_began("c", 0.0, 10.0)  # beat at 5
    plan = schedule.pause_began("c", 1.0, 4.0)  # the gateway's lease shrank
    assert plan is not None and plan.next_at == 3.0
    assert schedule.next_deadline() == 3.0


def test_a_dropped_plan_reads_as_never_due_to_whoever_holds_it() -> None:
    schedule = HeartbeatSchedule(KvturnSettings(), {}.get)
    plan = schedule.pause_began("c", 0.0, 10.0)
    assert plan is not None
    schedule.stop("c")
    assert plan.next_at == math.inf
    plan = schedule.pause_began("c", 0.0, 10.0)
    schedule.clear()
    assert plan is not None and plan.next_at == math.inf


def test_a_due_plan_of_a_conversation_in_flight_is_sent_to_the_beat() -> None:
    # No pause in progress (a request is in flight): the beat function decides (and drops it).
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=100), {}.get)
    schedule.pause_began("c", 0.0, 10.0)
    assert [e.conversation_id for e in schedule.take_due(5.0)] == ["c"]


def test_a_beat_late_past_its_lease_is_sent_and_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    schedule = HeartbeatSchedule(KvturnSettings(max_pause_seconds=100))
    schedule.start("on-time", paused_at=0.0, lease_seconds=4.0)  # due at 2, lease ends at 4
    schedule.start("late", paused_at=0.0, lease_seconds=2.0)  # due at 1, lease ends at 2
    with caplog.at_level(logging.WARNING, logger="kvturn.client"):
        due = schedule.take_due(3.0)  # a blocked event loop wakes the worker only now
    assert sorted(e.conversation_id for e in due) == ["late", "on-time"]
    (record,) = caplog.records
    assert "conversation late is 2.0 s late, more than the time between" in record.getMessage()
