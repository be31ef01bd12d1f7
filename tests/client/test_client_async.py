"""kvturn.client.AsyncOpenAI against the stand-in gateway."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from kvturn_stub_gateway import StubGateway
from kvturn_test_helpers import TOOLS, USER, http, tool_result

from kvturn import headers as h
from kvturn.client import AsyncOpenAI, current_conversation

CID = h.CONVERSATION_ID.lower()
TID = h.TURN_ID.lower()
PMS = h.PAUSE_MS.lower()
PKIND = h.PAUSE_KIND.lower()


@pytest_asyncio.fixture(loop_scope="function")
async def make_client() -> AsyncIterator[object]:
    opened: list[AsyncOpenAI] = []

    def make(stub: StubGateway, **kwargs: object) -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=stub.url, api_key="test", **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield make
    for client in opened:
        await client.close()


async def ask(client: AsyncOpenAI, **kwargs: object) -> object:
    return await client.chat.completions.create(model="m", messages=USER, **kwargs)  # type: ignore[call-overload]


async def test_headers_arrive(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub)
    async with client.conversation("a-conv") as conversation:
        assert current_conversation() is conversation
        await ask(client)
        await ask(client)
    assert current_conversation() is None
    first, second = stub.chat_requests()
    assert first.headers[CID] == second.headers[CID] == "a-conv"
    assert first.headers["x-stainless-async"].startswith("async")
    assert first.headers[TID] != second.headers[TID]
    assert PMS not in first.headers and second.headers[PKIND] == "user"


@pytest.mark.parametrize("status", ["500", "429"])
async def test_turn_id_survives_a_retried_request(
    stub: StubGateway, make_client, status: str
) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub)
    async with client.conversation():
        stream = await ask(client, stream=True, extra_headers={"X-Stub-Fail-First": status})
        async for _ in stream:  # type: ignore[attr-defined]
            pass
    failed, retried = stub.chat_requests()
    assert failed.headers["x-stainless-retry-count"] == "0"
    assert retried.headers["x-stainless-retry-count"] == "1"
    assert failed.headers[TID] == retried.headers[TID]


@pytest.mark.parametrize("stream", [False, True])
async def test_pause_covers_the_real_sleep_and_little_more(
    stub: StubGateway,
    make_client,  # type: ignore[no-untyped-def]
    stream: bool,
) -> None:
    client = make_client(stub)
    slept: list[float] = []
    async with client.conversation():
        for pause_s in (0.25, 0.1, 0.0):
            reply = await ask(client, stream=stream)
            if stream:
                async for _ in reply:  # type: ignore[attr-defined]
                    pass
            start = time.monotonic()
            await asyncio.sleep(pause_s)
            slept.append((time.monotonic() - start) * 1000)
    pauses = [int(r.headers[PMS]) for r in stub.chat_requests()[1:]]
    # The pause runs from the reply's end to the next request: the sleep, plus the client's
    # own work around it (a few ms; a loaded 2-core machine can stretch that tenfold and more,
    # hence the wide upper bound). Exact values: test_an_injected_clock_makes_pauses_exact.
    for reported, real in zip(pauses[:2], slept[:2], strict=True):
        assert real - 1 <= reported <= real + 250, (pauses, slept)
    assert pauses[0] >= 250 and pauses[1] >= 100


async def test_a_closed_stream_ends_the_reply(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub)
    async with client.conversation() as conversation:
        stream = await ask(client, stream=True, extra_headers={"X-Stub-Chunk-Delay-Ms": "20"})
        async with stream:  # type: ignore[attr-defined]
            await stream.__anext__()  # type: ignore[attr-defined]
            assert conversation.in_flight == 1
        assert conversation.in_flight == 0


async def test_a_stream_left_early_stays_open(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub)
    async with client.conversation() as conversation:
        stream = await ask(client, stream=True)
        async for _ in stream:  # type: ignore[attr-defined]
            break  # leaving the loop does not end the reply: the stream can go on
        assert conversation.in_flight == 1
        async for _ in stream:  # type: ignore[attr-defined]
            pass
        assert conversation.in_flight == 0


async def test_tool_pause_and_heartbeats_long_vs_short(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    # Heartbeats go at half the lease: 0.5 s, ten times the short pauses below, so that a
    # loaded machine's late timers cannot make a short pause long. (At a 0.2 s lease, a
    # heartbeat in flight when the next turn began landed after it beside a CPU hog.)
    stub.lease_seconds = 1.0
    client = make_client(stub)
    async with client.conversation("a-beats") as conversation:
        reply = await ask(client, tools=TOOLS)
        await asyncio.sleep(0.05)  # a short tool pause: no heartbeat
        assert stub.heartbeats == []
        await client.chat.completions.create(model="m", messages=tool_result(reply), tools=TOOLS)
        await ask(client, tools=TOOLS)
        await asyncio.sleep(1.3)  # a long tool pause: heartbeats keep the lease
        assert stub.heartbeats
        await ask(client)
        await asyncio.sleep(0.05)  # a short user pause before leaving: no heartbeat for it
    beats = list(stub.heartbeats)
    # Every one was for the long tool pause (one in flight as the next turn began may land
    # after it: it is still a tool pause's).
    assert 1 <= len(beats) <= 4, beats
    assert {b.body["pause_kind"] for b in beats} == {"tool"}
    assert [t.pause.kind for t in conversation.turns[1:]] == ["tool", "user", "tool"]  # type: ignore[union-attr]
    assert stub.releases == ["a-beats"]


async def test_one_heartbeat_task_per_client(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    stub.lease_seconds = 0.1
    client = make_client(stub)

    async def converse(cid: str) -> None:
        async with client.conversation(cid):
            await ask(client)
            await asyncio.sleep(0.3)  # the first beat is due at ~0.05 s

    before = asyncio.all_tasks()
    await asyncio.gather(converse("t1"), converse("t2"), converse("t3"))
    assert {b.conversation_id for b in stub.heartbeats} == {"t1", "t2", "t3"}
    workers = [t for t in asyncio.all_tasks() - before if "HeartbeatTask._run" in repr(t)]
    assert len(workers) == 1
    assert sorted(stub.releases) == ["t1", "t2", "t3"]


async def test_parallel_requests_in_one_conversation(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub)
    async with client.conversation() as conversation:
        await ask(client)
        await asyncio.gather(
            *(ask(client, extra_headers={"X-Stub-Delay-Ms": "30"}) for _ in range(3))
        )
        assert conversation.in_flight == 0
    burst = stub.chat_requests()[1:]
    assert len({r.headers[TID] for r in burst}) == 3
    assert sum(PMS in r.headers for r in burst) == 1


async def test_with_options_keeps_kvturn(stub: StubGateway, make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(stub, max_pause_seconds=7.0)
    derived = client.with_options(timeout=3.0)
    assert isinstance(derived, AsyncOpenAI)
    assert derived.kvturn_settings.max_pause_seconds == 7.0
    async with client.conversation("opts"):
        await derived.chat.completions.create(model="m", messages=USER)
    assert stub.chat_requests()[0].headers[CID] == "opts"


async def test_plain_server_falls_silent(
    plain_server: StubGateway,
    make_client,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = make_client(plain_server, default_lease_seconds=0.1)
    caplog.set_level(logging.INFO, logger="kvturn.client")
    async with client.conversation():
        await ask(client, tools=TOOLS)
        await asyncio.sleep(0.3)
        await ask(client)
        await asyncio.sleep(0.2)
    assert len([r for r in plain_server.requests if "kvturn" in r.path]) == 1
    assert len(plain_server.chat_requests()) == 2


def test_heartbeats_follow_the_client_to_a_new_event_loop(stub: StubGateway) -> None:
    # Scripts often run each step in asyncio.run(): the worker task dies with its loop, and
    # the first pause on the next loop must start a new one.
    # Beats due 0.2 s into a pause: the plan made on the first loop still covers the first
    # pause on the second, so only the client's check of the worker's loop starts a worker.
    stub.lease_seconds = 0.4
    client = AsyncOpenAI(base_url=stub.url, api_key="test", release_on_exit=False)

    async def step(pause_s: float) -> None:
        # A connection pool cannot outlive its loop either: each step gets its own HTTP client
        # (a copy shares the kvturn state: conversations, schedule, worker).
        async with http.AsyncClient() as step_http:
            step_client = client.with_options(http_client=step_http)
            async with step_client.conversation("loops"):
                await ask(step_client)
                await ask(step_client)
                await asyncio.sleep(pause_s)

    asyncio.run(step(0.0))
    before = len(stub.heartbeats)
    asyncio.run(step(1.5))  # beats due every ~0.2 s
    assert len(stub.heartbeats) - before >= 2
    asyncio.run(client.with_options(http_client=http.AsyncClient()).release_conversation("loops"))
    assert stub.releases == ["loops"]


class _Counting(openai.AsyncOpenAI):
    """Another subclass of the SDK's client, with an override of its own."""

    calls: list[str] = []

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("request")
        return await super().request(*args, **kwargs)


class _Mixed(AsyncOpenAI, _Counting):
    """Another SDK subclass after kvturn's in the MRO: its override and kvturn both work."""


@pytest.mark.parametrize("stream", [False, True])
async def test_a_subclass_with_another_sdk_subclass_in_between_keeps_both(
    stub: StubGateway, stream: bool
) -> None:
    _Counting.calls = []
    client = _Mixed(base_url=stub.url, api_key="test", heartbeats=False, release_on_exit=False)
    try:
        async with client.conversation("mixed") as conversation:
            reply = await ask(client, stream=stream)
            if stream:
                async for _ in reply:  # type: ignore[attr-defined]
                    pass
        assert _Counting.calls == ["request"]
        assert stub.chat_requests()[0].headers[CID] == "mixed"
        assert conversation.turn_count == 1 and conversation.in_flight == 0
    finally:
        await client.close()
