"""Gateway HTTP behaviour against a fake engine (routing, errors, control API, headers)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvturn import control
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from tests import fake_engine
from tests.gateway_fixtures import free_port, running_fake_engine, running_gateway


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture
def gateway(fake_url: str) -> Iterator[str]:
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as running:
        yield running.url


#: A request whose turn leaves KV worth reusing: the fake engine counts a token a byte, and
#: this renders to more than the gateway's ``reuse_threshold_tokens`` (64).
ASK = {"role": "user", "content": "Read the repository and list the modules that import the wire."}
#: What a next turn adds that is too long for the holder to prefill itself (more than
#: ``max_local_suffix_tokens``, 2048): the turn pulls the history into prefill.
LONG_TAIL = [
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "Here is the file, read it all. " + "0123456789" * 210},
]


def _chat(
    url: str, stream: bool = False, delay_ms: int = 0, tail: bool = False, **headers: str
) -> httpx.Response:
    """A turn of :data:`ASK`; ``tail``: with :data:`LONG_TAIL` after it (a turn that pulls)."""
    messages = [ASK, *LONG_TAIL] if tail else [ASK]
    body = {"model": "fake", "messages": messages, "stream": stream}
    if delay_ms:
        body["fake_delay_ms"] = delay_ms
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers)


def test_conversation_turns_reuse_and_say_so(gateway: str) -> None:
    first = _chat(gateway, **{"X-Conversation-Id": "c1"})
    assert first.status_code == 200
    assert first.headers["x-kvturn-plan"] == "recompute"
    assert first.headers["x-kvturn-lease-seconds"] == "60"
    assert first.json().get("kv_transfer_params") is None  # engine-internal, as vLLM shows it
    second = _chat(gateway, stream=True, tail=True, **{"X-Conversation-Id": "c1"})
    assert second.headers["x-kvturn-plan"] == "pull-reuse"
    assert second.headers["x-kvturn-plan-reason"] == "suffix-too-long"
    assert int(second.headers["x-kvturn-reused-tokens"]) > 0
    assert second.text.endswith("data: [DONE]\n\n")
    metrics = httpx.get(gateway + "/metrics").text
    assert 'kvturn_turns_total{plan="pull-reuse"} 1.0' in metrics


def test_a_pull_prefills_ahead_of_recomputes_and_a_clients_priority_is_its_own(
    fake_url: str,
) -> None:
    """A pull's prefill request computes only the new suffix: it goes with the configured
    priority (vLLM runs lower first), a recompute with none (vLLM's 0), and a priority the
    client set is passed on as it came."""
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]), pull_priority=-3
    )
    with running_gateway(config) as running:
        fake_engine.PREFILL_PRIORITIES.clear()
        ids = {"X-Conversation-Id": "prioritized"}
        assert _chat(running.url, **ids).headers["x-kvturn-plan"] == "recompute"
        assert _chat(running.url, tail=True, **ids).headers["x-kvturn-plan"] == "pull-reuse"
        assert fake_engine.PREFILL_PRIORITIES == [0, -3]
        body = {"model": "fake", "messages": [ASK, *LONG_TAIL], "priority": 5}
        ids = {"X-Conversation-Id": "its-own"}
        httpx.post(running.url + "/v1/chat/completions", json={**body, "messages": [ASK]},
                   headers=ids)  # fmt: skip
        pulled = httpx.post(running.url + "/v1/chat/completions", json=body, headers=ids)
        assert pulled.headers["x-kvturn-plan"] == "pull-reuse"
        assert fake_engine.PREFILL_PRIORITIES[-2:] == [5, 5]


def test_a_conversation_is_told_the_lease_its_decode_grants(
    fake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode whose connector grants at most 20 s: the gateway (lease 60 s) asks for 20,
    says 20 in the turn's header, and a heartbeat's answer asks for the next beat within half
    of that, so a client that follows them never lets the lease lapse (issue: leases that tell
    the truth)."""
    from tests import fake_engine

    monkeypatch.setattr(fake_engine, "MAX_LEASE_S", 20.0)
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]), lease_s=60
    )
    with running_gateway(config) as running:
        decode = running.app.state.gateway.decode.instances[0]
        _until(lambda: decode.max_lease_s == 20.0, "the decode's longest lease was never learned")
        first = _chat(running.url, **{"X-Conversation-Id": "short-lease"})
        assert first.headers["x-kvturn-lease-seconds"] == "20"
        _recorded(running, "short-lease")
        beat = httpx.post(
            running.url + "/v1" + control.heartbeat_path("short-lease"),
            json={"pause_kind": "tool", "paused_ms": 5},
        )
        answer = control.HeartbeatResponse.model_validate_json(beat.content)
        assert answer.known and 0 < answer.lease_remaining_s <= 20
        assert answer.next_heartbeat_s is not None and answer.next_heartbeat_s <= 10


def test_a_client_that_beats_gets_the_short_heartbeat_lease(fake_url: str) -> None:
    """A client that says it beats through its pauses (``X-Kvturn-Heartbeats: on``) is leased
    for one beat's span (``heartbeat_lease_s``), told so, and each beat renews by that much:
    a client that stops beating frees the KV that soon, not a whole ``lease_s`` later. A
    client that does not say so gets ``lease_s``, which must span its whole pause (issue:
    leases that cost what they are worth)."""
    from tests import fake_engine

    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]),
        lease_s=60, heartbeat_lease_s=8,
    )  # fmt: skip
    with running_gateway(config) as running:
        beating = _chat(running.url, **{"X-Conversation-Id": "beats", "X-Kvturn-Heartbeats": "on"})
        assert beating.headers["x-kvturn-lease-seconds"] == "8"
        assert fake_engine.LAST_LEASE_ASKED["retain"] == 8
        _recorded(running, "beats")
        beat = httpx.post(
            running.url + "/v1" + control.heartbeat_path("beats"),
            json={"pause_kind": "tool", "paused_ms": 4000},
        )
        answer = control.HeartbeatResponse.model_validate_json(beat.content)
        assert fake_engine.LAST_LEASE_ASKED["renew"] == 8
        assert answer.known and answer.lease_remaining_s == 8 and answer.next_heartbeat_s == 4
        silent = _chat(running.url, **{"X-Conversation-Id": "silent"})
        assert silent.headers["x-kvturn-lease-seconds"] == "60"
        assert fake_engine.LAST_LEASE_ASKED["retain"] == 60
        # Anything but "on" is not a promise to beat.
        other = _chat(running.url, **{"X-Conversation-Id": "maybe", "X-Kvturn-Heartbeats": "1"})
        assert other.headers["x-kvturn-lease-seconds"] == "60"


def test_a_heartbeat_lease_longer_than_the_lease_is_the_lease() -> None:
    config = GatewayConfig(lease_s=5, heartbeat_lease_s=10)
    assert config.lease_for(heartbeats=True) == config.lease_for(heartbeats=False) == 5
    with pytest.raises(ValueError, match="heartbeat_lease_s"):
        GatewayConfig(heartbeat_lease_s=0)
    with pytest.raises(ValueError, match="heartbeat_lease_s"):
        GatewayConfig(heartbeat_lease_s=0.4, expiry_margin_s=0.5)


def test_conversation_id_from_body_or_prompt_cache_key(gateway: str) -> None:
    for field in ("conversation_id", "prompt_cache_key"):
        for messages in ([ASK], [ASK, *LONG_TAIL]):
            body = {"model": "fake", "messages": messages, field: f"k-{field}"}
            response = httpx.post(gateway + "/v1/chat/completions", json=body)
        assert response.headers["x-kvturn-plan"] == "pull-reuse", field
        assert response.headers["x-conversation-id"] == f"k-{field}"


def test_heartbeat_and_release(gateway: str) -> None:
    unknown = httpx.post(gateway + "/v1" + control.heartbeat_path("nobody"), json={})
    assert control.HeartbeatResponse.model_validate_json(unknown.content).known is False
    _chat(gateway, **{"X-Conversation-Id": "c2"})
    beat = httpx.post(
        gateway + "/v1" + control.heartbeat_path("c2"), json={"pause_kind": "tool", "paused_ms": 5}
    )
    answer = control.HeartbeatResponse.model_validate_json(beat.content)
    assert answer.known and 0 < answer.lease_remaining_s <= 60
    released = httpx.delete(gateway + "/v1" + control.release_path("c2"))
    assert control.ReleaseResponse.model_validate_json(released.content).released is True
    again = httpx.delete(gateway + "/v1" + control.release_path("c2"))
    assert control.ReleaseResponse.model_validate_json(again.content).released is False
    assert _chat(gateway, **{"X-Conversation-Id": "c2"}).headers["x-kvturn-plan"] == "recompute"
    bad = httpx.post(gateway + "/v1" + control.heartbeat_path("c2"), json={"pause_kind": "nap"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "status", "code"),
    # What the gateway itself must read; the rest of a request is the engine's to judge.
    [(b"[1, 2]", 400, None), (b"{not json", 400, None), (b'"text"', 400, None)],
)
def test_errors_are_openai_shaped(
    gateway: str, content: bytes, status: int, code: str | None
) -> None:
    response = httpx.post(gateway + "/v1/chat/completions", content=content)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == code


def test_invalid_conversation_ids_are_rejected(gateway: str) -> None:
    # Any string is an id but one with control characters or over 1,024 bytes (the rule and
    # every form: test_conversation_ids.py).
    for bad in ("x" * 1025, "UTF-8''%FF", "a\nb", "é" * 513):
        response = (
            _chat(gateway, **{"X-Conversation-Id": bad})
            if bad.isascii() and bad.isprintable()
            else httpx.post(
                gateway + "/v1/chat/completions",
                json={
                    "model": "fake",
                    "messages": [{"role": "user", "content": "x"}],
                    "conversation_id": bad,
                },
            )
        )
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "conversation_id"


def test_parallel_turns_never_share_retained_kv(gateway: str) -> None:
    """Retained blocks are single-use: of two simultaneous turns only one may pull them."""
    import concurrent.futures

    _chat(gateway, **{"X-Conversation-Id": "par"})
    # No waiting here: a turn waits for its conversation's previous reply to be recorded.

    def turn(_: int) -> str:
        # Each engine call takes 300 ms, so both turns are in flight together.
        response = _chat(gateway, delay_ms=300, tail=True, **{"X-Conversation-Id": "par"})
        return response.headers["x-kvturn-plan"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plans = sorted(pool.map(turn, range(2)))
    assert plans == ["pull-reuse", "recompute"]


def test_a_stream_is_relayed_chunk_by_chunk(gateway: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake_slow_stream": 5}  # fmt: skip
    arrivals = []
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["x-kvturn-plan"] == "recompute"
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter(), line))
    assert [line for _, line in arrivals][-1] == "data: [DONE]"
    assert len(arrivals) == 6
    # Not buffered: the events arrive spread out as the engine sends them (20 ms apart).
    assert arrivals[4][0] - arrivals[0][0] > 0.06


def test_a_reader_leaving_a_stream_stops_it_at_the_engine(gateway: str, fake_url: str) -> None:
    counts = httpx.get(fake_url + "/fake/counts").json()
    before, released = counts["abandoned"], counts.get("releases", 0)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake_slow_stream": 200}  # 4 s if nobody stops it  # fmt: skip
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The gateway notices the reader left, closes its stream to the engine, which stops.
    deadline = time.monotonic() + 10
    while httpx.get(fake_url + "/fake/counts").json()["abandoned"] == before:
        assert time.monotonic() < deadline, "the engine kept streaming to nobody"
        time.sleep(0.02)
    # What decode kept of the abandoned turn is released at once: nobody comes back for it.
    while httpx.get(fake_url + "/fake/counts").json().get("releases", 0) == released:
        assert time.monotonic() < deadline, "the abandoned turn's KV was not released"
        time.sleep(0.02)
    # The gateway is fine afterwards.
    assert _chat(gateway).status_code == 200


def test_the_connection_serves_on_after_a_stream_that_spanned_several_reads(gateway: str) -> None:
    # While a stream is relayed, the gateway watches for its reader leaving; once it ends, the
    # watch is called off. Calling it off once cancelled the connection's own "gone" future,
    # and the next request on the connection was cancelled unanswered (real engines stream
    # in many reads; the example agents' replays failed "Server disconnected without sending
    # a response").
    slow = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake_slow_stream": 5}  # fmt: skip
    with httpx.Client(timeout=10, limits=httpx.Limits(max_connections=1)) as client:
        for _ in range(2):
            with client.stream("POST", gateway + "/v1/chat/completions", json=slow) as response:
                assert response.status_code == 200
                assert b"".join(response.iter_raw()).endswith(b"data: [DONE]\n\n")
        released = client.delete(gateway + "/v1/kvturn/conversations/never-seen")
        assert released.status_code == 200
        after = client.post(gateway + "/v1/chat/completions", json={**slow, "stream": False})
        assert after.status_code == 200


def test_a_reader_that_leaves_once_it_has_done_keeps_the_conversations_kv(gateway: str) -> None:
    # The reader has the whole reply at ``[DONE]`` and may close its connection before the
    # engine's body ends (seen with the openai SDK on real engines: the next turn found
    # nothing held and recomputed). The turn is complete: its KV is kept for the next turn.
    body = {"model": "fake", "messages": [ASK], "stream": True,
            "fake_end_delay_ms": 300}  # fmt: skip
    headers = {"X-Conversation-Id": "done-then-gone"}
    for messages in ([ASK], [ASK, *LONG_TAIL]):
        body["messages"] = messages
        with httpx.stream(
            "POST", gateway + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # and the connection closes, the engine's body not yet ended
        time.sleep(0.6)  # the engine's body ends; the turn is recorded
    second_plan = response.headers["x-kvturn-plan"]
    assert second_plan == "pull-reuse", response.headers.get("x-kvturn-plan-reason")


def test_a_stream_breaking_off_ends_with_an_openai_error_event(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"fake_slow_stream": 10, "fake_break_after": 3},
    )
    received = []
    with pytest.raises(openai.APIError, match="stream broke off"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["0 ", "1 ", "2 "]
    assert _chat(gateway).status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(gateway: str) -> None:
    missing = httpx.get(gateway + "/v1/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    wrong = httpx.get(gateway + "/v1/chat/completions")
    assert wrong.status_code == 405
    assert "GET /v1/chat/completions" in wrong.json()["error"]["message"]


def test_an_unexpected_failure_is_an_openai_shaped_500(fake_url: str) -> None:
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as running:

        async def broken(turn: object) -> None:
            raise RuntimeError("bug")

        running.app.state.gateway.runner.run = broken
        response = _chat(running.url)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"


def test_a_conversation_released_mid_turn_leaves_no_lease(gateway: str, fake_url: str) -> None:
    """The client releases while a turn still streams: the KV that turn leaves is released on
    the decode as soon as it is published, not left to lapse."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake_slow_stream": 10}  # fmt: skip
    headers = {"X-Conversation-Id": "mid-release"}
    before = httpx.get(fake_url + "/fake/counts").json().get("releases", 0)
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, headers=headers) as r:
        released = httpx.delete(gateway + "/v1" + control.release_path("mid-release"))
        assert released.json()["released"] is True
        assert list(r.iter_lines())[-2] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while httpx.get(fake_url + "/fake/counts").json().get("releases", 0) == before:
        assert time.monotonic() < deadline, "the turn's lease was never released"
        time.sleep(0.02)
    again = _chat(gateway, **headers)
    assert again.headers["x-kvturn-plan"] == "recompute"


def test_status_route_shows_the_table_engines_and_planner(gateway: str) -> None:
    _chat(gateway, **{"X-Conversation-Id": "status-1"})
    _chat(gateway, **{"X-Session-ID": "status-2"})
    status = httpx.get(gateway + "/kvturn/status").json()
    assert status["conversations"] == 2
    roles = sorted(engine["role"] for engine in status["engines"])
    assert roles == ["decode", "prefill"]
    assert all(engine["healthy"] for engine in status["engines"])
    assert status["planner"]["decode_local"] is True
    assert status["planner"]["implicit_conversations"] is True
    assert set(status["costs"]) == {"prefill", "local", "pull", "handoff"}
    # The prefill round trips were learned from.
    assert sum(fit["observations"] for fit in status["costs"]["prefill"].values()) == 2


def test_requests_without_an_id_continue_an_implicit_conversation(gateway: str) -> None:
    """A plain client that resends its history (the reply, then something new) is served as
    the next turn of the conversation its history started; a new history starts another."""
    messages = [ASK]
    body = {"model": "fake", "messages": messages}
    first = httpx.post(gateway + "/v1/chat/completions", json=body)
    assert first.headers["x-kvturn-plan"] == "recompute"
    implicit_id = first.headers["x-conversation-id"]
    assert implicit_id.startswith("implicit-")
    reply = first.json()["choices"][0]["message"]
    body["messages"] = [*messages, reply, {"role": "user", "content": "and then?"}]
    deadline = time.monotonic() + 5
    while True:  # the gateway records where turn 1's KV lives just after the reply
        second = httpx.post(gateway + "/v1/chat/completions", json=body)
        if second.headers["x-kvturn-plan"] != "recompute" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert second.headers["x-conversation-id"] == implicit_id
    # It extends turn 1 with a short message: the holder continues it (planned from a bound
    # on its new tokens, see kvturn.gateway.extension).
    assert second.headers["x-kvturn-plan"] == "decode-local"
    other = httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": "fake", "messages": [{"role": "user", "content": "something else"}]},
    )
    assert other.headers["x-conversation-id"] != implicit_id
    metrics = httpx.get(gateway + "/metrics").text
    assert 'kvturn_implicit_conversations_total{result="matched"} 1.0' in metrics


def test_only_histories_with_a_reply_are_looked_up(fake_url: str) -> None:
    """A recorded turn is its messages plus a reply: a first request (no assistant message)
    has nothing to find, and of a longer one only the prefixes ending in a reply are asked."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        runner = gateway.app.state.gateway.runner
        asked: list[int] = []
        match = runner.context.store.implicit.match

        async def counted(digests: Any) -> Any:
            asked.append(len(digests))
            return await match(digests)

        runner.context.store.implicit.match = counted
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        first = httpx.post(gateway.url + "/v1/chat/completions", json=_chat_body(messages))
        assert asked == []
        _until(lambda: runner.context.store.implicit.size() == 1, "turn 1 was never recorded")
        reply = first.json()["choices"][0]["message"]
        messages = [*messages, reply, {"role": "user", "content": "and?"}]
        second = httpx.post(gateway.url + "/v1/chat/completions", json=_chat_body(messages))
        assert asked == [1]
        assert second.headers["x-conversation-id"] == first.headers["x-conversation-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_is_marked_under_way_only_while_its_record_must_wait(
    fake_url: str, stream: bool
) -> None:
    """A stream is marked as under way when it starts: a next turn that comes before its
    record (which waits for decode to say where the KV stays) waits for it. A non-streamed
    reply says where its KV stays: recorded at once, with no mark. Either way the record
    indexes the conversation by the turn's messages and reply, in the same call (a next turn
    that comes first finds it by the older turn's, and waits if it was marked). A new
    conversation takes nothing (its key was just drawn), and nobody can find it before it is
    indexed: its first write makes the entry, indexes it, and marks a stream, as the stream
    ends; its record indexes it again, now with where its KV stays (what a fork of it reads).
    One table call for a new conversation's non-streamed turn, two for a streamed one (Redis
    had three and four)."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        runner = gateway.app.state.gateway.runner
        calls: list[str] = []

        def noted(name: str, call: Any) -> Any:
            def note(*args: Any, **kwargs: Any) -> Any:
                fresh = args[2] if name == "mark" and args[2:] else kwargs.get("fresh")
                findable = args[3] if name == "mark" and args[3:] else kwargs.get("findable")
                made = " made" if fresh is not None else ""
                indexed = " indexed" if findable is not None else ""
                calls.append(name + made + indexed)
                return call(*args, **kwargs)

            return note

        runner.context.store.take = noted("take", runner.context.store.take)
        runner.context.store.settling = noted("mark", runner.context.store.settling)
        runner.context.store.record = noted("record", runner.context.store.record)
        messages = [{"role": "user", "content": f"marked while streamed? {stream}"}, ASK]
        body = {**_chat_body(messages), "stream": stream}
        first = httpx.post(gateway.url + "/v1/chat/completions", json=body)
        assert first.status_code == 200
        _until(lambda: len(calls) == (2 if stream else 1), f"recorded: {calls}")
        expected = ["mark made indexed", "record indexed"] if stream else ["record made indexed"]
        assert calls == expected
        conversation = first.headers["x-conversation-id"]
        entry = runner.context.store.peek(scoped_key("", conversation))
        assert entry is not None and entry.turns == 1 and entry.holder_url == fake_url
        if stream:
            reply = {"role": "assistant", "content": _streamed_text(first.text)}
        else:
            reply = first.json()["choices"][0]["message"]
        calls.clear()
        messages = [*messages, reply, {"role": "user", "content": "and?"}]
        second = httpx.post(gateway.url + "/v1/chat/completions", json=_chat_body(messages))
        assert second.headers["x-conversation-id"] == conversation
        assert second.headers["x-kvturn-plan"] == "decode-local"
        _until(lambda: len(calls) == 2, f"recorded: {calls}")
        assert calls == ["take", "record indexed"]
        reply = second.json()["choices"][0]["message"]
        calls.clear()
        messages = [*messages, reply, {"role": "user", "content": "and then?"}]
        third = httpx.post(
            gateway.url + "/v1/chat/completions", json={**body, "messages": messages}
        )
        assert third.headers["x-conversation-id"] == conversation
        _until(lambda: len(calls) == (3 if stream else 2), f"recorded: {calls}")
        assert calls == (
            ["take", "mark", "record indexed"] if stream else ["take", "record indexed"]
        )
        assert runner.context.store.peek(scoped_key("", conversation)).turns == 3


def _streamed_text(sse: str) -> str:
    """The content of a streamed chat reply, from its SSE text."""
    parts = []
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _chat_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "fake", "messages": messages}


#: A turn that the holder continues when it comes again: what the holder keeps of it is over
#: the reuse threshold, and what it adds is short.
LOCAL_MESSAGES = [ASK]


def _turn(url: str, conversation: str, stream: bool = False) -> httpx.Response:
    body = {"model": "fake", "messages": LOCAL_MESSAGES, "stream": stream}
    response = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
    )
    assert response.status_code == 200, response.text
    return response


def _counted(name: str, before: int, failure: str) -> None:
    """Wait (up to 5 s) for the fake engines' counter ``name`` to move past ``before``."""
    from tests import fake_engine

    deadline = time.monotonic() + 5
    while fake_engine.COUNTS.get(name, 0) == before:
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def _recorded(gateway: Any, conversation: str) -> None:
    deadline = time.monotonic() + 5
    store = gateway.app.state.gateway.store
    key = scoped_key("", conversation)
    while store.peek(key) is None or store.peek(key).holder_url is None:
        assert time.monotonic() < deadline, "the turn's KV location was never recorded"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_a_short_turn_continues_on_the_holder_without_prefill(fake_url: str, stream: bool) -> None:
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        conversation = f"local-{stream}"
        assert _turn(gateway.url, conversation).headers["x-kvturn-plan"] == "recompute"
        _recorded(gateway, conversation)
        counts = dict(fake_engine.COUNTS)
        second = _turn(gateway.url, conversation, stream=stream)
        assert second.headers["x-kvturn-plan"] == "decode-local"
        assert second.headers["x-kvturn-plan-reason"] == "cheaper"
        assert fake_engine.COUNTS["prefill"] == counts["prefill"]  # no prefill ran
        # The holder was told the request is on its way (it steps often until it arrives).
        _counted("expected", counts.get("expected", 0), "the holder was never told")
        assert fake_engine.COUNTS["decode_local"] == counts.get("decode_local", 0) + 1
        assert fake_engine.COUNTS["tokenize"] == counts.get("tokenize", 0) + 1
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'kvturn_kv_bytes_moved_total{plan="decode-local"} 0.0' in metrics


def test_a_next_turn_finds_a_local_turn_recorded_however_slow_its_old_lease_is_to_free(
    fake_url: str,
) -> None:
    """A decode-local turn's claim on the lease it continued ends after its reply, with one
    control call to the holder; the turn's record (where its KV is now) does not wait on that
    call. A busy holder answers it slowly (here 2 s, past the half second a next turn waits
    for its conversation's record): the next turn still finds the new lease and continues on
    it, not a turn it must share KV with (``parallel``)."""
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        assert _turn(gateway.url, "slow-release").headers["x-kvturn-plan"] == "recompute"
        _recorded(gateway, "slow-release")
        fake_engine.RELEASE_DELAY_S = 2.0
        try:
            second = _turn(gateway.url, "slow-release")
            assert second.headers["x-kvturn-plan"] == "decode-local"
            third = _turn(gateway.url, "slow-release")
            assert third.headers["x-kvturn-plan"] == "decode-local"
            assert third.headers["x-kvturn-plan-reason"] == "cheaper"
        finally:
            fake_engine.RELEASE_DELAY_S = 0.0


def test_only_a_decode_idle_for_a_while_is_woken_as_a_turn_starts(fake_url: str) -> None:
    """An idle decode engine steps 10 ms apart for its first 2 s of idleness and a quarter
    second apart after: a wake as a turn starts is sent to one that this gateway has sent
    nothing for a while, not to one it sent a turn a moment ago."""
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        decode = gateway.app.state.gateway.decode.instances[0]
        before = fake_engine.COUNTS.get("woken", 0)
        assert _chat(gateway.url).status_code == 200
        _counted("woken", before, "an engine never sent anything was not woken")
        woken = fake_engine.COUNTS["woken"]
        for _ in range(3):
            assert _chat(gateway.url).status_code == 200
        decode.last_sent -= 5  # as if 5 s had passed since
        assert _chat(gateway.url).status_code == 200
        _counted("woken", woken, "an engine idle for 5 s was not woken")
        assert fake_engine.COUNTS["woken"] == woken + 1  # the 3 turns in between woke nothing


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


_CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "/"}'}}
_REPLY = {"role": "assistant", "content": "", "tool_calls": [_CALL]}
_TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "bin etc home usr var"}


def _turn_with(
    url: str,
    conversation: str,
    messages: list[dict[str, Any]],
    stream: bool = False,
    **fields: Any,
) -> httpx.Response:
    body = {"model": "fake", "messages": messages, "stream": stream, **fields}
    response = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
    )
    assert response.status_code == 200, response.text
    return response


def _until(check: Any, failure: str) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_that_extends_the_held_one_is_planned_without_counting(
    fake_url: str, stream: bool
) -> None:
    """Its messages start with the held turn's: a bound on its new tokens plans it, and its
    prompt is counted after the reply (metrics, costs, the bound checked)."""
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        conversation = f"extending-{stream}"
        messages = [ASK]
        first = _turn_with(gateway.url, conversation, messages)
        assert first.headers["x-kvturn-plan"] == "recompute"
        _recorded(gateway, conversation)
        counts = dict(fake_engine.COUNTS)
        counted = _metric(gateway.url, "kvturn_prompt_count_seconds_count")
        recomputed = _metric(gateway.url, "kvturn_recomputed_tokens_total")
        messages = [*messages, _REPLY, _TOOL_RESULT]
        second = _turn_with(gateway.url, conversation, messages, stream)
        assert second.headers["x-kvturn-plan"] == "decode-local"
        assert fake_engine.COUNTS["prefill"] == counts["prefill"]
        assert _metric(gateway.url, "kvturn_prompt_count_seconds_count") == counted
        assert _metric(gateway.url, "kvturn_uncounted_turns_total") == 1
        # Counted once the reply is over (the prompt as the engine tokenizes it).
        _counted("tokenize", counts.get("tokenize", 0), "the turn was never counted")
        _until(
            lambda: _metric(gateway.url, "kvturn_recomputed_tokens_total") > recomputed,
            "the counted tokens never reached the metrics",
        )
        reused = int(second.headers["x-kvturn-reused-tokens"])
        prompt = len(fake_engine.prompt_ids(_chat_body(messages)))
        assert _metric(gateway.url, "kvturn_recomputed_tokens_total") == (
            recomputed + prompt - reused
        )
        assert _metric(gateway.url, "kvturn_bound_violations_total") == 0
        assert gateway.app.state.gateway.runner.context.bound_extensions


def test_a_bound_that_does_not_hold_turns_planning_by_bounds_off(fake_url: str) -> None:
    """The engine's template rendered the new messages to more tokens than their bytes (the
    fake's template pads every message by ``pad_messages`` tokens): from then on every turn is
    counted while planning, and this one's suffix of two padded messages (over 5000 tokens)
    goes to P/D."""
    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    padded = {"chat_template_kwargs": {"pad_messages": 2500}}
    with running_gateway(config) as gateway:
        messages = [{"role": "user", "content": "list the root directory"}]
        _turn_with(gateway.url, "long", messages, **padded)
        _recorded(gateway, "long")
        messages = [*messages, _REPLY, _TOOL_RESULT]
        second = _turn_with(gateway.url, "long", messages, **padded)
        assert second.headers["x-kvturn-plan"] == "decode-local"
        _until(
            lambda: _metric(gateway.url, "kvturn_bound_violations_total") == 1,
            "the bound was never checked",
        )
        assert not gateway.app.state.gateway.runner.context.bound_extensions
        _recorded(gateway, "long")
        counted = _metric(gateway.url, "kvturn_prompt_count_seconds_count")
        third = _turn_with(gateway.url, "long", [*messages, _REPLY, _TOOL_RESULT], **padded)
        assert third.headers["x-kvturn-plan"] == "pull-reuse"
        assert third.headers["x-kvturn-plan-reason"] == "suffix-too-long"
        assert _metric(gateway.url, "kvturn_prompt_count_seconds_count") == counted + 1
        assert _metric(gateway.url, "kvturn_uncounted_turns_total") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_where_a_turn_left_its_kv_is_asked_only_of_a_streamed_reply(
    fake_url: str, stream: bool
) -> None:
    """A non-streamed reply carries what decode retains (the connector's params, handed back
    by vLLM); a stream does not, so the gateway asks decode's control server."""
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]))
    with running_gateway(config) as gateway:
        conversation = f"told-{stream}"
        asked = fake_engine.COUNTS.get("retained_asked", 0)
        messages = [{"role": "user", "content": "where is it kept?"}]
        _turn_with(gateway.url, conversation, messages, stream)
        _recorded(gateway, conversation)
        held = gateway.app.state.gateway.store.peek(scoped_key("", conversation))
        # Its prompt and its reply, less the reply's last token (whose KV is never computed).
        prompt = len(fake_engine.prompt_ids(_chat_body(messages)))
        assert held.held_tokens == prompt + 1 and held.held_digest is not None
        assert fake_engine.COUNTS.get("retained_asked", 0) == asked + (1 if stream else 0)


def test_an_idle_prefill_engine_counts_the_prompt_not_the_holder() -> None:
    """The holder is being woken for the turn; an idle prefill engine renders the same
    template with the same tokenizer, faster (see TurnRunner._counter)."""
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as holder:
        config = GatewayConfig(prefill=endpoints([prefill]), decode=endpoints([holder], [holder]))
        with running_gateway(config) as gateway:
            _turn(gateway.url, "counted-on-prefill")
            _recorded(gateway, "counted-on-prefill")
            counts = dict(fake_engine.COUNTS)
            second = _turn(gateway.url, "counted-on-prefill")
            assert second.headers["x-kvturn-plan"] == "decode-local"
            on = {url: f"tokenize:{url.rsplit(':', 1)[1]}" for url in (prefill, holder)}
            assert fake_engine.COUNTS.get(on[prefill], 0) == counts.get(on[prefill], 0) + 1
            assert fake_engine.COUNTS.get(on[holder], 0) == counts.get(on[holder], 0)


def test_a_conversations_prefills_go_to_one_engine_and_forks_follow_it() -> None:
    """With two prefills, every P/D turn of a conversation goes to the same one (its prefix
    cache may hold the history), a request that starts with the same two messages (a fork, a
    subagent, under another id or none) goes there too, and conversations spread over both."""
    from tests import fake_engine

    with running_fake_engine() as p1, running_fake_engine() as p2, running_fake_engine() as d:
        config = GatewayConfig(
            prefill=endpoints([p1, p2]), decode=endpoints([d], [d]), decode_local=False
        )
        ports = {url.rsplit(":", 1)[1]: url for url in (p1, p2)}

        def served_by(messages: list[dict[str, Any]], **headers: str) -> str:
            before = {port: fake_engine.COUNTS.get(f"prefill:{port}", 0) for port in ports}
            response = httpx.post(
                gateway.url + "/v1/chat/completions",
                json={"model": "fake", "messages": messages},
                headers=headers,
            )
            assert response.status_code == 200, response.text
            moved = [p for p in ports if fake_engine.COUNTS.get(f"prefill:{p}", 0) > before[p]]
            assert len(moved) == 1, moved
            return ports[moved[0]]

        with running_gateway(config) as gateway:
            placed = {}
            for n in range(12):
                history = [
                    {"role": "system", "content": "You are a careful agent."},
                    {"role": "user", "content": f"task {n}"},
                ]
                first = served_by(history, **{"X-Conversation-Id": f"c{n}"})
                for turn in range(2):
                    history += [
                        {"role": "assistant", "content": f"step {turn}"},
                        {"role": "user", "content": f"tool result {turn}"},
                    ]
                    assert served_by(history, **{"X-Conversation-Id": f"c{n}"}) == first
                # A subagent forked from the conversation's context, with an id of its own
                # and with none.
                fork = [*history[:4], {"role": "user", "content": "subtask"}]
                assert served_by(fork, **{"X-Conversation-Id": f"sub{n}"}) == first
                assert served_by(fork) == first
                placed[n] = first
            assert set(placed.values()) == {p1, p2}  # spread, not all on one


def test_a_holder_that_fails_a_local_turn_means_recompute_elsewhere() -> None:
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as holder:  # noqa: SIM117
        with running_fake_engine() as other:
            config = GatewayConfig(
                prefill=endpoints([prefill]),
                decode=endpoints([holder, other], [holder, other]),
            )
            with running_gateway(config) as gateway:
                _turn(gateway.url, "failing-holder")
                _recorded(gateway, "failing-holder")
                store = gateway.app.state.gateway.store
                assert store.peek(scoped_key("", "failing-holder")).holder_url == holder
                ended = fake_engine.COUNTS.get("claims_ended", 0)
                fake_engine.FAIL_DECODE_PORTS.add(int(holder.rsplit(":", 1)[1]))
                try:
                    second = _turn(gateway.url, "failing-holder")
                    # The holder broke after planning: the turn is served again, plainly,
                    # on the other decode, and the lease it claimed and would have superseded
                    # is freed, its claim ended.
                    assert second.headers["x-kvturn-plan"] == "recompute"
                    assert second.headers["x-kvturn-plan-reason"] == "decode-failed"
                    _counted("claims_ended", ended, "the old lease was not released")
                    _recorded(gateway, "failing-holder")
                    assert store.peek(scoped_key("", "failing-holder")).holder_url == other
                    # Every decode failing: the prefill engine serves the turn alone.
                    fake_engine.FAIL_DECODE_PORTS.add(int(other.rsplit(":", 1)[1]))
                    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
                    alone = httpx.post(gateway.url + "/v1/chat/completions", json=body)
                    assert alone.status_code == 200, alone.text
                    assert alone.json()["choices"][0]["message"]["content"] == "ok"
                    assert alone.headers["x-kvturn-plan-reason"] == "decode-failed-twice"
                    # Prefill failing as well: an OpenAI-shaped 502, never an internal error.
                    fake_engine.FAIL_DECODE_PORTS.add(int(prefill.rsplit(":", 1)[1]))
                    failed = httpx.post(gateway.url + "/v1/chat/completions", json=body)
                    assert failed.status_code == 502, failed.text
                    message = failed.json()["error"]["message"]
                    assert message.startswith("no decode engine, and prefill failed too"), message
                finally:
                    fake_engine.FAIL_DECODE_PORTS.clear()


def test_a_decode_whose_stream_fails_before_its_first_token_means_recompute_elsewhere() -> None:
    """vLLM answers a streamed request with 200 at once and reports a failure inside the
    stream: measured on two hosts, a decode whose read of prefill's KV timed out sent a role and
    an error event, and the client got that error. No byte of a reply had reached it: the turn
    is served again on the other decode, and the client sees only that reply."""
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as first:  # noqa: SIM117
        with running_fake_engine() as other:
            config = GatewayConfig(
                prefill=endpoints([prefill]), decode=endpoints([first, other], [first, other])
            )
            with running_gateway(config) as gateway:
                _turn(gateway.url, "error-stream")
                _recorded(gateway, "error-stream")
                store = gateway.app.state.gateway.store
                holder = store.peek(scoped_key("", "error-stream")).holder_url
                spare = other if holder == first else first
                errors = fake_engine.COUNTS.get("error_streams", 0)
                fake_engine.ERROR_STREAM_DECODE_PORTS.add(int(holder.rsplit(":", 1)[1]))
                try:
                    second = _turn(gateway.url, "error-stream", stream=True)
                    _counted("error_streams", errors, "the holder's stream never failed")
                    assert second.headers["x-kvturn-plan"] == "recompute"
                    assert second.headers["x-kvturn-plan-reason"] == "decode-failed"
                    assert "error" not in second.text
                    chunks = [
                        json.loads(line[5:])
                        for line in second.text.splitlines()
                        if line.startswith("data: {")
                    ]
                    content = [
                        c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]
                    ]
                    assert "".join(c or "" for c in content) == "ok"
                    assert second.text.rstrip().endswith("data: [DONE]")
                    _until(
                        lambda: store.peek(scoped_key("", "error-stream")).holder_url == spare,
                        "the turn's KV was not recorded on the other decode",
                    )
                finally:
                    fake_engine.ERROR_STREAM_DECODE_PORTS.clear()


def test_a_holder_whose_control_server_is_silent_is_not_the_turns_decode() -> None:
    """Stop 54's CI failure: the holder's host was unplugged, its claim went unanswered, and
    the recomputed turn was sent to decode on that same holder (preferred, and still healthy
    as far as the last health check knew). A holder that does not answer its claim is avoided
    for the turn's decode: the turn recomputes on the other decode at once."""
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as holder:  # noqa: SIM117
        with running_fake_engine() as other:
            config = GatewayConfig(
                prefill=endpoints([prefill]),
                decode=endpoints([holder, other], [holder, other]),
                health_interval_s=600,  # the turn itself finds the silent holder
            )
            messages = [ASK]
            with running_gateway(config) as gateway:
                _turn_with(gateway.url, "silent-holder", messages)
                _recorded(gateway, "silent-holder")
                store = gateway.app.state.gateway.store
                assert store.peek(scoped_key("", "silent-holder")).holder_url == holder
                port = int(holder.rsplit(":", 1)[1])
                served = {
                    url: fake_engine.COUNTS.get(f"decode:{url.rsplit(':', 1)[1]}", 0)
                    for url in (holder, other)
                }
                fake_engine.SILENT_CONTROL_PORTS.add(port)
                try:  # a long new message: it plans a pull, not a local turn
                    second = _turn_with(gateway.url, "silent-holder", [*messages, *LONG_TAIL])
                finally:
                    fake_engine.SILENT_CONTROL_PORTS.clear()
                assert second.headers["x-kvturn-plan"] == "recompute"
                assert second.headers["x-kvturn-plan-reason"] == "holder-unhealthy"
                assert fake_engine.COUNTS.get(f"decode:{port}", 0) == served[holder]
                assert fake_engine.COUNTS[f"decode:{other.rsplit(':', 1)[1]}"] == served[other] + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_a_turn_is_answered_while_either_side_has_an_engine(dead: str, stream: bool) -> None:
    """A pool with no engine that answers: the other pool's engine serves the turn alone (a
    vLLM engine is whole either way), never a 5xx while an engine lives. A decode serving
    alone keeps the conversation's KV as after any decode turn; a prefill keeps none."""
    with running_fake_engine() as alive:
        gone = f"http://127.0.0.1:{free_port()}"
        prefill, decode = (gone, alive) if dead == "prefill" else (alive, gone)
        config = GatewayConfig(
            prefill=endpoints([prefill]),
            decode=endpoints([decode], [decode]),
            health_interval_s=600,  # the turns themselves find the dead engine
        )
        with running_gateway(config) as gateway:
            name = f"alone-{dead}-{stream}"
            for tail in (False, True):  # the second turn plans a pull (a long new message)
                answer = _chat(gateway.url, stream, tail=tail, **{"X-Conversation-Id": name})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-kvturn-plan"] == "recompute"
                expected = "no-prefill" if dead == "prefill" else "no-decode"
                assert answer.headers["x-kvturn-plan-reason"] == expected
                if stream:
                    assert answer.text.endswith("data: [DONE]\n\n")
                else:
                    assert answer.json()["choices"][0]["message"]["content"] == "ok"
            if dead == "prefill":  # the decode holds the conversation's KV
                _recorded(gateway, name)
                assert (
                    gateway.app.state.gateway.store.peek(scoped_key("", name)).holder_url == decode
                )
            metrics = httpx.get(gateway.url + "/metrics").text
            assert f'kvturn_reuse_fallbacks_total{{reason="{expected}"}} 2.0' in metrics
            # Ready all the same (a load balancer keeps sending turns), though not all well.
            health = httpx.get(gateway.url + "/health")
            assert health.status_code == 200 and health.json()["ok"] is False
            assert health.json()[dead] == {gone: False}


@pytest.mark.parametrize("stream", [False, True])
def test_push_turns_pair_prefill_and_decode_and_survive_a_failed_prefill(stream: bool) -> None:
    """Push mode's orchestration (the engines' side is tests/test_push_engines.py): prefill
    and decode get the turn at once under one request id; a prefill that fails leaves decode
    waiting for a write that never comes, so the gateway aborts that request and serves the
    turn on a decode alone."""
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as decode:
        config = GatewayConfig(
            prefill=endpoints([prefill], [prefill]),
            decode=endpoints([decode], [decode]),
            transfer="push",
        )
        with running_gateway(config) as gateway:
            before = dict(fake_engine.COUNTS)
            first = _turn(gateway.url, f"push-{stream}", stream=stream)
            assert first.headers["x-kvturn-plan"] == "recompute"
            assert first.headers["x-kvturn-plan-reason"] == "first-turn"
            assert fake_engine.COUNTS["prefill"] == before["prefill"] + 1
            assert fake_engine.COUNTS["decode"] == before["decode"] + 1
            # The holder's prefix cache serves the next short turn: no prefill at all.
            _recorded(gateway, f"push-{stream}")
            second = _turn(gateway.url, f"push-{stream}", stream=stream)
            assert second.headers["x-kvturn-plan"] == "decode-local"
            assert fake_engine.COUNTS["prefill"] == before["prefill"] + 1

            fake_engine.FAIL_PREFILL_PORTS.add(int(prefill.rsplit(":", 1)[1]))
            try:
                abandoned = fake_engine.COUNTS.get("push_abandoned", 0)
                body = {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                        "stream": stream}  # fmt: skip
                started = time.monotonic()
                failed = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
                assert failed.status_code == 200, failed.text
                assert time.monotonic() - started < 5
                assert failed.headers["x-kvturn-plan"] == "recompute"
                assert failed.headers["x-kvturn-plan-reason"] == "prefill-failed"
                _counted("push_abandoned", abandoned, "decode's push request was not aborted")
            finally:
                fake_engine.FAIL_PREFILL_PORTS.clear()


@pytest.mark.parametrize("stream", [False, True])
def test_a_push_whose_write_never_arrives_is_served_by_decode_alone(stream: bool) -> None:
    """Prefill answered (so it writes), but the KV never reaches decode (a failed write, or
    prefill died after answering): nothing in vLLM tells decode, which would wait for good.
    The gateway asks decode's control server and, after ``push_write_timeout_s``, aborts the
    request and serves the turn on a decode alone."""
    from tests import fake_engine

    with running_fake_engine() as prefill, running_fake_engine() as decode:
        config = GatewayConfig(
            prefill=endpoints([prefill], [prefill]),
            decode=endpoints([decode], [decode]),
            transfer="push",
            push_write_timeout_s=0.5,
        )
        with running_gateway(config) as gateway:
            body = {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                    "stream": stream}  # fmt: skip
            fake_engine.LOSE_WRITE_PORTS.add(int(prefill.rsplit(":", 1)[1]))
            try:
                abandoned = fake_engine.COUNTS.get("push_abandoned", 0)
                started = time.monotonic()
                lost = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
                assert lost.status_code == 200, lost.text
                assert 0.5 <= time.monotonic() - started < 5
                assert lost.headers["x-kvturn-plan-reason"] == "push-lost"
                assert '"ok"' in lost.text or '"k"' in lost.text  # the fake decode's reply
                _counted("push_abandoned", abandoned, "decode's push request was not aborted")
            finally:
                fake_engine.LOSE_WRITE_PORTS.clear()
            # A push that arrives is not waited on.
            started = time.monotonic()
            fine = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
            assert fine.status_code == 200
            assert fine.headers["x-kvturn-plan-reason"] != "push-lost"
            assert time.monotonic() - started < 0.4


def test_the_callers_request_id_and_trace_reach_the_engines_and_come_back(gateway: str) -> None:
    from tests import fake_engine

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for stream in (False, True):
        response = _chat(
            gateway, stream, **{"X-Request-Id": "req-42.a:b", "traceparent": parent,
                                "tracestate": "vendor=1"},
        )  # fmt: skip
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "req-42.a:b"
        for role in ("prefill", "decode"):
            seen = fake_engine.LAST_HEADERS[role]
            # The engines' ids start with the caller's (their logs name it), then 128 random
            # bits of the gateway's own (decode keeps the turn's KV under it).
            assert seen["x-request-id"].startswith("req-42.a:b-kvturn-"), (role, seen)
            assert len(seen["x-request-id"]) == len("req-42.a:b-kvturn-") + 32
            assert seen["traceparent"] == parent and seen["tracestate"] == "vendor=1"
        # A fresh id per engine request.
        assert fake_engine.LAST_HEADERS["prefill"] != fake_engine.LAST_HEADERS["decode"]


def test_a_request_id_that_cannot_travel_inside_engine_ids_is_still_echoed(gateway: str) -> None:
    from tests import fake_engine

    for odd in ("user@example.com/7", "x" * 200):
        response = _chat(gateway, **{"X-Request-Id": odd})
        assert response.status_code == 200 and response.headers["x-request-id"] == odd
        assert fake_engine.LAST_HEADERS["decode"]["x-request-id"].startswith("kvturn-")
        assert "traceparent" not in fake_engine.LAST_HEADERS["decode"]


def test_without_a_request_id_the_reply_names_the_engine_request(gateway: str) -> None:
    from tests import fake_engine

    response = _chat(gateway)
    assert response.headers["x-request-id"] == fake_engine.LAST_HEADERS["decode"]["x-request-id"]
    # A refused request echoes the caller's id too.
    refused = httpx.post(
        gateway + "/v1/chat/completions", content=b"not json", headers={"X-Request-Id": "r1"}
    )
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "r1"


def test_a_stream_longer_than_the_request_timeout_completes(fake_url: str) -> None:
    # 40 chunks 20 ms apart (0.8 s) through a gateway whose engine requests time out after
    # 0.3 s of silence: the timeout bounds waiting, not the length of a reply.
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        request_timeout_s=0.3,
    )
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake_slow_stream": 40}  # fmt: skip
    with running_gateway(config) as running:
        started = time.monotonic()
        response = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=10)
        elapsed = time.monotonic() - started
    assert response.status_code == 200 and elapsed > 0.7
    events = [e for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 41
    assert "error" not in response.text


def test_decodes_without_a_control_server_serve_plain_pd(fake_url: str) -> None:
    """Stock engines (vLLM's own NixlConnector, no kvturn control server): listed without
    control URLs, every turn of a conversation is answered and recomputes; the gateway never
    calls a control API there is none of."""
    from tests import fake_engine

    config = GatewayConfig(prefill=endpoints([fake_url]), decode=endpoints([fake_url]))
    before = dict(fake_engine.COUNTS)
    with running_gateway(config) as running:
        for turn in range(3):
            for stream in (False, True):
                response = _chat(running.url, stream, **{"X-Conversation-Id": "stock-pd"})
                assert response.status_code == 200, response.text
                assert response.headers["x-kvturn-plan"] == "recompute", (turn, stream)
    control = {k: v - before.get(k, 0) for k, v in fake_engine.COUNTS.items()}
    assert control["decode"] == 6
    for call in ("claims", "releases", "retained_asked", "woken"):
        assert control.get(call, 0) == 0, call


@pytest.mark.parametrize("own", [None, 0, 32, "all"])
def test_a_pull_counts_only_what_prefill_did_not_hold(
    fake_url: str, monkeypatch: pytest.MonkeyPatch, own: int | str | None
) -> None:
    """Prefill's usage counts its own prefix-cache hits and the pulled tokens alike; its
    connector says which were its own. The pull's cost is learned from what it moved, and a
    planned pull that moved nothing (prefill already held what the lease did) is said so
    (``recompute``/``prefill-cached``) and frees its claim at once, not when the claim times
    out. An engine that says nothing is taken at its usage's word, as before.

    ``own``: None, an engine that says nothing (and has no prefix cache of its own); 0, one
    that says its cache served nothing; 32, one whose cache holds the prompt's first two
    blocks; ``all``, one whose cache holds the whole prompt (its first turn's)."""
    from tests import fake_engine

    body = _chat_body([ASK])
    prompt = fake_engine.prompt_ids(body)
    # What prefill reads of the lease: the whole digest chunks of the held prompt that the
    # new one (the same) starts with, never its last token.
    held = min(len(prompt) // 16 * 16, len(prompt) - 1)
    assert len(prompt) % fake_engine.BLOCK_SIZE, "a prompt of whole blocks: 'all' would pull"
    monkeypatch.setattr(fake_engine, "PREFILL_REPORTS_OWN_CACHED", own is not None)
    monkeypatch.setattr(fake_engine, "PREFILL_PREFIX_CACHING", own == "all")
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]), decode_local=False
    )
    with running_gateway(config) as gateway:
        costs = gateway.app.state.gateway.runner.context.costs
        observed: list[tuple[int, int]] = []
        learn = costs.observe_prefill

        def spy(url: str, computed: int, pulled: int, seconds: float) -> None:
            observed.append((computed, pulled))
            learn(url, computed, pulled, seconds)

        monkeypatch.setattr(costs, "observe_prefill", spy)
        conversation = f"own-{own}"
        _chat(gateway.url, **{"X-Conversation-Id": conversation})
        _recorded(gateway, conversation)
        if own == 32:  # prefill's cache: the prompt's first 2 blocks, then another block
            monkeypatch.setattr(fake_engine, "PREFILL_PREFIX_CACHING", True)
            primer = {"model": "fake", "prompt": prompt[:32] + [0] * 16, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            assert httpx.post(fake_url + "/v1/completions", json=primer).status_code == 200
        ended = fake_engine.COUNTS.get("claims_ended", 0)
        second = _chat(gateway.url, **{"X-Conversation-Id": conversation})
        assert int(second.headers["x-kvturn-reused-tokens"]) == held
        computed = len(prompt) - held
        if own == "all":
            assert second.headers["x-kvturn-plan"] == "recompute"
            assert second.headers["x-kvturn-plan-reason"] == "prefill-cached"
            assert observed[-1] == (computed, 0)  # no pull to learn from
            _counted("claims_ended", ended, "the claim of a lease nobody read was kept")
        else:
            assert second.headers["x-kvturn-plan"] == "pull-reuse"
            # Learned from the tokens the pull moved: what it reports less prefill's own.
            assert observed[-1] == (computed, held - (own if isinstance(own, int) else 0))
            assert costs.pull.observations == 1
            assert fake_engine.COUNTS.get("claims_ended", 0) == ended
