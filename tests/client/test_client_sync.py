"""kvturn.client.OpenAI against the stand-in gateway."""

from __future__ import annotations

import contextvars
import gc
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from kvturn_stub_gateway import StubGateway
from kvturn_test_helpers import TOOLS, USER, tool_result

from kvturn import headers as h
from kvturn.client import OpenAI, Pause, current_conversation
from kvturn.client._conversation import begin_turn, finish_turn

CID = h.CONVERSATION_ID.lower()
TID = h.TURN_ID.lower()
PMS = h.PAUSE_MS.lower()
PKIND = h.PAUSE_KIND.lower()


_opened: list[OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def make_client(stub: StubGateway, **kwargs: object) -> OpenAI:
    client = OpenAI(base_url=stub.url, api_key="test", **kwargs)  # type: ignore[arg-type]
    _opened.append(client)
    return client


def ask(client: OpenAI, **kwargs: object) -> object:
    return client.chat.completions.create(model="m", messages=USER, **kwargs)  # type: ignore[call-overload]


def test_headers_arrive_and_pauses_follow_the_first_turn(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation("conv-1") as conversation:
        ask(client)
        ask(client)
    first, second = stub.chat_requests()
    assert first.headers[CID] == second.headers[CID] == "conv-1"
    assert len(first.headers[TID]) == 32 and first.headers[TID] != second.headers[TID]
    assert PMS not in first.headers and PKIND not in first.headers
    assert int(second.headers[PMS]) >= 0 and second.headers[PKIND] == "user"
    assert conversation.turn_count == 2
    assert [t.turn_id for t in conversation.turns] == [first.headers[TID], second.headers[TID]]


@pytest.mark.parametrize("heartbeats", [True, False])
def test_a_client_says_whether_it_beats_through_pauses(stub: StubGateway, heartbeats: bool) -> None:
    """The gateway leases a beating client's KV for one beat's span only: a client that does
    not beat must not say it does, or its KV would lapse mid-pause."""
    client = make_client(stub, heartbeats=heartbeats)
    with client.conversation("beats"):
        ask(client)
        ask(client)
    for request in stub.chat_requests():
        assert request.headers.get(h.HEARTBEATS.lower()) == ("on" if heartbeats else None)


def test_default_id_is_a_uuid4_and_known_before_entering(stub: StubGateway) -> None:
    client = make_client(stub)
    scope = client.conversation()
    assert uuid.UUID(scope.id).version == 4
    with scope as conversation:
        assert current_conversation() is conversation
        ask(client)
    assert current_conversation() is None
    assert stub.chat_requests()[0].headers[CID] == scope.id


def test_requests_outside_a_conversation_carry_nothing(stub: StubGateway) -> None:
    client = make_client(stub)
    ask(client)
    headers = stub.chat_requests()[0].headers
    assert CID not in headers and TID not in headers


def test_invalid_ids_are_refused(stub: StubGateway) -> None:
    for bad in ("", "has\nnewline", "x" * 1025):
        with pytest.raises(ValueError):
            make_client(stub).conversation(bad).__enter__()


@pytest.mark.parametrize("status", ["500", "429"])
@pytest.mark.parametrize("stream", [False, True])
def test_turn_id_survives_a_retried_request(stub: StubGateway, status: str, stream: bool) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        ask(client)
        reply = ask(client, stream=stream, extra_headers={"X-Stub-Fail-First": status})
        if stream:
            list(reply)  # type: ignore[call-overload]
    first, failed, retried = stub.chat_requests()
    assert failed.headers["x-stainless-retry-count"] == "0"
    assert retried.headers["x-stainless-retry-count"] == "1"
    assert failed.headers[TID] == retried.headers[TID] != first.headers[TID]
    # The retry reports the same pause: the pause ended when the turn started, not per attempt.
    assert failed.headers[PMS] == retried.headers[PMS]
    assert conversation.turn_count == 2


@pytest.mark.parametrize("stream", [False, True])
def test_pause_covers_the_real_sleep_and_little_more(stub: StubGateway, stream: bool) -> None:
    client = make_client(stub)
    slept: list[float] = []
    with client.conversation():
        for pause_s in (0.25, 0.1, 0.0):
            reply = ask(client, stream=stream)
            if stream:
                list(reply)  # type: ignore[call-overload]
            # The sleep as it really happened: a loaded machine oversleeps.
            start = time.monotonic()
            time.sleep(pause_s)
            slept.append((time.monotonic() - start) * 1000)
    pauses = [int(r.headers[PMS]) for r in stub.chat_requests()[1:]]
    # The pause runs from the reply's end to the next request: the sleep, plus the client's
    # own work around it (a few ms; a loaded 2-core machine can stretch that tenfold and more,
    # hence the wide upper bound). Exact values: test_an_injected_clock_makes_pauses_exact.
    for reported, real in zip(pauses[:2], slept[:2], strict=True):
        assert real - 1 <= reported <= real + 250, (pauses, slept)
    assert pauses[0] >= 250 and pauses[1] >= 100


def test_a_stream_pause_starts_when_the_stream_is_exhausted(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        stream = ask(client, stream=True)
        time.sleep(1.0)  # still reading: not a pause
        list(stream)  # type: ignore[call-overload]
        time.sleep(0.05)
        ask(client)
    pause = conversation.turns[-1].pause
    assert pause is not None and 49 <= pause.ms < 1000  # not the 1 s spent reading


def test_a_closed_stream_ends_the_reply(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        with ask(client, stream=True, extra_headers={"X-Stub-Chunk-Delay-Ms": "20"}) as stream:
            next(iter(stream))  # type: ignore[call-overload]
        assert conversation.in_flight == 0
        time.sleep(0.05)
        ask(client)
    pause = conversation.turns[-1].pause
    assert pause is not None and 49 <= pause.ms < 300  # counted from the close


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_finish_reason_starts_a_tool_pause(stub: StubGateway, stream: bool) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        if stream:
            chunks = list(ask(client, tools=TOOLS, stream=True))  # type: ignore[call-overload]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            reply = ask(client, tools=TOOLS)  # the tool pause, then a non-streamed turn
        else:
            reply = ask(client, tools=TOOLS)
            assert reply.choices[0].finish_reason == "tool_calls"  # type: ignore[attr-defined]
        client.chat.completions.create(model="m", messages=tool_result(reply), tools=TOOLS)
    kinds = [r.headers.get(PKIND) for r in stub.chat_requests()]
    assert kinds == [None, "tool", "tool"] if stream else kinds == [None, "tool"]
    assert conversation.turns[-1].tool_calls is False


def test_a_stream_left_early_stays_open_and_an_abandoned_one_ends(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        stream = ask(client, stream=True)
        for _ in stream:  # type: ignore[attr-defined]
            break  # leaving the loop does not end the reply: the stream can go on
        assert conversation.in_flight == 1
        list(stream)  # type: ignore[call-overload]
        assert conversation.in_flight == 0
        stream = ask(client, stream=True)
        next(iter(stream))  # type: ignore[call-overload]
        assert conversation.in_flight == 1
        del stream  # abandoned: its reply ends when it is collected
        gc.collect()
        assert conversation.in_flight == 0
        assert conversation.turn_count == 2


def test_raw_responses_are_tracked_too(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation() as conversation:
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=USER, tools=TOOLS
        )
        assert raw.parse().choices[0].finish_reason == "tool_calls"
        raw_stream = client.chat.completions.with_raw_response.create(
            model="m", messages=USER, stream=True
        )
        assert conversation.in_flight == 1  # its reply has not been read yet
        list(raw_stream.parse())
        assert conversation.in_flight == 0
    assert [r.headers.get(PKIND) for r in stub.chat_requests()] == [None, "tool"]


def test_gateway_answers_are_recorded_on_turns(stub: StubGateway) -> None:
    stub.lease_seconds = 12.5
    client = make_client(stub)
    with client.conversation() as conversation:
        ask(client)
        ask(client)
        assert conversation.lease_seconds == 12.5
        stub.lease_seconds = 7.0  # the gateway's lease changes: the client follows
        ask(client)
        assert conversation.lease_seconds == 7.0
    first, second, _ = conversation.turns
    assert (first.plan, first.reused_tokens) == ("recompute", 0)
    assert second.plan == "pull-reuse" and (second.reused_tokens or 0) > 0


def test_heartbeats_during_a_long_tool_pause_none_during_a_short_one(stub: StubGateway) -> None:
    # Margins of 5x and more on a loaded 2-core machine: first beat after ~0.5 s, then every
    # ~0.5 s; the short pause is a tenth of that.
    stub.lease_seconds = 1.0
    client = make_client(stub)
    with client.conversation("beats") as conversation:
        reply = ask(client, tools=TOOLS)
        time.sleep(0.05)  # short: a tenth of half the lease
        short_pause_beats = len(stub.heartbeats)
        reply = client.chat.completions.create(model="m", messages=tool_result(reply), tools=TOOLS)
        reply = ask(client, tools=TOOLS)
        time.sleep(2.3)  # long tool pause: beats at ~0.5, 1.0, 1.5, 2.0 s
        long_pause_beats = list(stub.heartbeats)
        ask(client)
        time.sleep(0.05)
        after_request = len(stub.heartbeats)
    assert short_pause_beats == 0
    assert 2 <= len(long_pause_beats) <= 5, long_pause_beats
    assert all(b.conversation_id == "beats" for b in long_pause_beats)
    assert all(b.body["pause_kind"] == "tool" for b in long_pause_beats)
    first_ms = long_pause_beats[0].body["paused_ms"]
    assert 450 <= first_ms <= 1000, first_ms  # about half the lease
    assert after_request == len(long_pause_beats)  # the request stopped them
    assert conversation.turns[-1].pause == Pause(
        ms=conversation.turns[-1].pause.ms,  # type: ignore[union-attr]
        kind="tool",
    )


def test_heartbeats_stop_at_the_maximum_pause_and_on_exit(stub: StubGateway) -> None:
    stub.lease_seconds = 0.5
    client = make_client(stub, max_pause_seconds=1.1)
    with client.conversation():
        ask(client)
        time.sleep(2.0)
        at_max = len(stub.heartbeats)
    assert 2 <= at_max <= 4  # beats at ~0.25, 0.5, 0.75, 1.0 s; none after 1.1 s
    with client.conversation():
        ask(client)
    time.sleep(0.75)  # scope left: no beats after exit
    assert len(stub.heartbeats) == at_max


def test_release_reaches_the_gateway(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation("to-release"):
        ask(client)
        assert "to-release" in stub.held
    assert stub.releases == ["to-release"]
    assert "to-release" not in stub.held
    assert "to-release" not in client.kvturn_conversations


def test_control_calls_inside_another_conversation_are_not_its_turns(stub: StubGateway) -> None:
    client = make_client(stub, release_on_exit=False)
    with client.conversation("outer") as outer:
        ask(client)
        with client.conversation("inner", release=True):
            ask(client)
        client.release_conversation("elsewhere")  # not known here: released all the same
        with client.conversation("kept"):
            ask(client)
        client.release_conversation("kept")
        assert outer.turn_count == 1 and outer.in_flight == 0
    assert stub.releases == ["inner", "elsewhere", "kept"]
    control = [r for r in stub.requests if "/conversations/" in r.path]
    assert len(control) == 3 and all(CID not in r.headers for r in control)


def test_no_release_when_asked_not_to_and_the_pause_carries_over(stub: StubGateway) -> None:
    client = make_client(stub, release_on_exit=False)
    with client.conversation("kept"):
        ask(client)
    time.sleep(0.1)
    with client.conversation("kept") as conversation:
        ask(client)
    assert stub.releases == []
    pause = conversation.turns[-1].pause
    assert pause is not None and pause.kind == "user" and pause.ms >= 90
    with client.conversation("kept", release=True):
        pass
    assert stub.releases == ["kept"]


def test_no_release_for_a_conversation_without_turns(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation():
        pass
    assert stub.releases == []


def test_with_options_and_copy_keep_kvturn(stub: StubGateway) -> None:
    client = make_client(stub, max_pause_seconds=42.0, heartbeats=False)
    for derived in (client.with_options(timeout=5.0), client.copy(max_retries=1)):
        assert isinstance(derived, OpenAI)
        assert derived.kvturn_settings.max_pause_seconds == 42.0
        assert derived.kvturn_settings.heartbeats is False
    with client.conversation("shared") as conversation:
        client.with_options(timeout=5.0).chat.completions.create(model="m", messages=USER)
    assert stub.chat_requests()[0].headers[CID] == "shared"
    assert conversation.turn_count == 1


class _Counting(openai.OpenAI):
    """Another subclass of the SDK's client, with an override of its own."""

    calls: list[str] = []

    def request(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("request")
        return super().request(*args, **kwargs)


class _Mixed(OpenAI, _Counting):
    """Another SDK subclass after kvturn's in the MRO: its override and kvturn both work."""


@pytest.mark.parametrize("stream", [False, True])
def test_a_subclass_with_another_sdk_subclass_in_between_keeps_both(
    stub: StubGateway, stream: bool
) -> None:
    _Counting.calls = []
    client = _Mixed(base_url=stub.url, api_key="test", heartbeats=False, release_on_exit=False)
    _opened.append(client)
    with client.conversation("mixed") as conversation:
        reply = ask(client, stream=stream)
        if stream:
            list(reply)  # type: ignore[call-overload]
    assert _Counting.calls == ["request"]
    assert stub.chat_requests()[0].headers[CID] == "mixed"
    assert conversation.turn_count == 1 and conversation.in_flight == 0


def test_parallel_requests_in_one_conversation(stub: StubGateway) -> None:
    client = make_client(stub)
    with client.conversation("par") as conversation:
        ask(client)
        time.sleep(0.05)
        with ThreadPoolExecutor(4) as pool:
            ctx = contextvars.copy_context
            futures = [
                pool.submit(ctx().run, ask, client, extra_headers={"X-Stub-Delay-Ms": "50"})
                for _ in range(3)
            ]
            # A thread without the context can name the open conversation by header.
            futures.append(
                pool.submit(
                    ask, client, extra_headers={"x-conversation-id": "par", "X-Stub-Delay-Ms": "50"}
                )
            )
            for f in futures:
                f.result()
        assert conversation.in_flight == 0
        ask(client)
    requests = stub.chat_requests()
    assert all(r.headers[CID] == "par" for r in requests)
    assert len({r.headers[TID] for r in requests}) == 6
    paused = [r for r in requests[1:5] if PMS in r.headers]
    assert len(paused) == 1  # the first of the parallel burst took the pause; the rest ran on
    assert PMS in requests[5].headers  # after the burst: paused since the last reply


def test_plain_server_headers_are_harmless_and_heartbeats_fall_silent(
    plain_server: StubGateway, caplog: pytest.LogCaptureFixture
) -> None:
    plain_server.lease_seconds = 0.2
    client = make_client(plain_server, default_lease_seconds=0.2)
    caplog.set_level(logging.INFO, logger="kvturn.client")
    with client.conversation():
        reply = ask(client, tools=TOOLS)
        time.sleep(0.5)  # the first beat is due at ~0.1 s
        client.chat.completions.create(model="m", messages=tool_result(reply), tools=TOOLS)
        time.sleep(0.5)
    posts = [r for r in plain_server.requests if "kvturn" in r.path]
    assert len(posts) == 1  # one refused heartbeat, then silence, and no release attempt
    assert client._kvturn.control_available is False
    assert any("no kvturn control API" in r.message for r in caplog.records)


def test_heartbeat_failures_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    # Nothing listens there: every control call fails with a connection error.
    client = OpenAI(
        base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0, default_lease_seconds=0.1
    )
    caplog.set_level(logging.WARNING, logger="kvturn.client")
    with client.conversation() as conversation:
        # Pretend a turn happened: begin/finish without the network.
        finish_turn(begin_turn(conversation), tool_calls=True)
        time.sleep(0.5)  # the first beat is due at ~0.05 s
    assert conversation.released
    assert any("heartbeat" in r.message for r in caplog.records)
    assert any("release" in r.message for r in caplog.records)
    client.close()
    assert not client._kvturn.worker.running  # type: ignore[union-attr]


def test_one_heartbeat_thread_per_client(stub: StubGateway) -> None:
    stub.lease_seconds = 0.1
    client = make_client(stub)
    before = set(threading.enumerate())
    scopes = [client.conversation() for _ in range(3)]
    for scope in scopes:
        scope.__enter__()
        ask(client)
    time.sleep(0.3)  # each one's first beat is due at ~0.05 s
    for scope in reversed(scopes):
        scope.__exit__(None, None, None)
    assert {b.conversation_id for b in stub.heartbeats} == {s.id for s in scopes}
    new_threads = set(threading.enumerate()) - before
    assert new_threads == {client._kvturn.worker._thread}  # type: ignore[union-attr]
    client.close()
    assert not client._kvturn.worker.running  # type: ignore[union-attr]


def test_an_injected_clock_makes_pauses_exact(stub: StubGateway) -> None:
    now = [1000.0]
    client = make_client(stub, clock=lambda: now[0], heartbeats=False)
    with client.conversation() as conversation:
        ask(client, tools=TOOLS)
        now[0] += 1.5
        ask(client)
        now[0] += 0.25
        ask(client)
    assert [r.headers.get(PMS) for r in stub.chat_requests()] == [None, "1500", "250"]
    assert [t.pause for t in conversation.turns] == [
        None,
        Pause(ms=1500, kind="tool"),
        Pause(ms=250, kind="user"),
    ]


def test_a_conversation_left_open_keeps_beating_until_released(stub: StubGateway) -> None:
    stub.lease_seconds = 0.1
    client = make_client(stub)
    with client.conversation("open", release=False):
        ask(client)
    time.sleep(0.5)  # beats every ~0.05 s
    beats = list(stub.heartbeats)
    assert len(beats) >= 2 and {b.body["pause_kind"] for b in beats} == {"user"}
    client.release_conversation("open")
    assert stub.releases == ["open"] and "open" not in client.kvturn_conversations
    count = len(stub.heartbeats)
    time.sleep(0.15)
    assert len(stub.heartbeats) == count
