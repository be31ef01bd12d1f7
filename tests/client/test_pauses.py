"""The pause clock of a conversation, driven by a fake clock (no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvturn.client import Conversation, OpenAI, Pause, Turn
from kvturn.client._conversation import begin_turn, finish_turn, resume_turn


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def client(clock: FakeClock) -> Iterator[OpenAI]:
    client = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", clock=clock, heartbeats=False)
    yield client
    client.close()


@pytest.fixture
def conversation(client: OpenAI) -> Iterator[Conversation]:
    with client.conversation(release=False) as conversation:
        yield conversation


def begin(client: OpenAI) -> Turn:
    conversation = client.kvturn_conversations[next(iter(client.kvturn_conversations))]
    return begin_turn(conversation)


def test_first_request_has_no_pause(client: OpenAI, conversation: Conversation) -> None:
    assert begin(client).pause is None
    assert conversation.in_flight == 1 and conversation.turn_count == 1


def test_pause_runs_from_reply_end_to_next_request(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    turn = begin(client)
    clock.advance(5.0)  # generation time is not pause
    finish_turn(turn, False)
    assert conversation._paused_since() == clock.now
    clock.advance(1.234)
    assert conversation.current_pause() == Pause(ms=1234, kind="user")
    assert begin(client).pause == Pause(ms=1234, kind="user")
    assert conversation.current_pause() is None


def test_tool_calls_make_a_tool_pause_and_the_kind_resets(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    finish_turn(begin(client), True)
    clock.advance(0.5)
    turn = begin(client)
    assert turn.pause == Pause(ms=500, kind="tool")
    finish_turn(turn, False)
    clock.advance(0.25)
    assert begin(client).pause == Pause(ms=250, kind="user")


def test_adapter_tool_start_marks_a_tool_pause(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    finish_turn(begin(client), False)
    conversation.tool_started()
    clock.advance(0.1)
    assert begin(client).pause == Pause(ms=100, kind="tool")


def test_parallel_requests_pause_only_when_nothing_is_in_flight(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    first = begin(client)
    second = begin(client)
    assert second.pause is None  # parallel to the first
    clock.advance(1.0)
    # One reply ends while the other is in flight: not idle, no pause yet.
    finish_turn(first, True)
    assert conversation._paused_since() is None and conversation.current_pause() is None
    clock.advance(1.0)
    finish_turn(second, False)
    assert conversation._paused_since() == clock.now
    clock.advance(0.3)
    # Measured from the last reply; tool because one of the replies asked for tools.
    assert begin(client).pause == Pause(ms=300, kind="tool")


def test_request_started_before_the_other_reply_ends_is_not_paused_twice(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    a, _b = begin(client), begin(client)
    finish_turn(a, True)  # A ends; B still in flight
    clock.advance(0.2)
    assert begin(client).pause == Pause(ms=200, kind="tool")  # C after A's tool ran
    assert begin(client).pause is None  # D parallel to C: no new reply ended


def test_a_turn_ends_once(client: OpenAI, conversation: Conversation) -> None:
    turn = begin(client)
    finish_turn(turn, False)
    finish_turn(turn, True)  # a stream closed after it was exhausted, say
    assert conversation.in_flight == 0 and turn.tool_calls is False


def test_a_retried_attempt_resumes_its_turn_and_the_gap_is_no_pause(
    client: OpenAI, conversation: Conversation, clock: FakeClock
) -> None:
    turn = begin(client)
    finish_turn(turn, False)  # the first attempt failed: its answer was read and closed
    clock.advance(0.5)  # the SDK's back-off
    resume_turn(turn)
    assert conversation.in_flight == 1 and not turn.finished and conversation.turn_count == 1
    assert conversation.current_pause() is None
    clock.advance(1.0)
    finish_turn(turn, True)
    clock.advance(0.2)
    second = begin(client)
    assert second.pause == Pause(ms=200, kind="tool")  # from the retry's reply
    resume_turn(second)  # resuming a turn that is in flight changes nothing
    assert conversation.in_flight == 1
