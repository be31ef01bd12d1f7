"""Completion batches split per prompt and merged back (no engines: the merge alone)."""

from __future__ import annotations

import orjson
import pytest

from kvturn.gateway.batches import BatchStream, batched_prompts, merge_bodies, serve_batch
from kvturn.gateway.replies import Reply
from tests.gateway_fixtures import ChunkStream


def test_only_lists_of_several_prompts_are_batches() -> None:
    path = "/v1/completions"
    assert batched_prompts(path, {"prompt": ["a", "b"]}) == ["a", "b"]
    assert batched_prompts(path, {"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]
    assert batched_prompts(path, {"prompt": ["a"]}) is None
    assert batched_prompts(path, {"prompt": [1, 2, 3]}) is None  # one prompt of token ids
    assert batched_prompts(path, {"prompt": "a"}) is None
    assert batched_prompts(path, {}) is None
    assert batched_prompts("/v1/chat/completions", {"prompt": ["a", "b"]}) is None


def _body(text: str, prompt_tokens: int, n: int = 1) -> dict[str, object]:
    return {
        "id": f"cmpl-{text}", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": i, "text": f"{text}{i}"} for i in range(n)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                  "total_tokens": prompt_tokens + 3, "prompt_tokens_details": {"cached_tokens": 1}},
    }  # fmt: skip


def test_bodies_merge_as_one_engine_numbers_a_batch() -> None:
    merged = merge_bodies([_body("a", 5, n=2), _body("b", 7, n=2)], choices_per_prompt=2)
    assert merged["id"] == "cmpl-a"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1"),
    ]  # fmt: skip
    assert merged["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 1},
    }  # fmt: skip


def _event(data: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _chunk(rid: str, index: int, text: str) -> bytes:
    return _event({"id": rid, "created": 1, "choices": [{"index": index, "text": text}]})


def _usage(rid: str, prompt_tokens: int) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": 2}
    return _event({"id": rid, "created": 1, "choices": [], "usage": usage})


async def test_streams_are_relabelled_renumbered_and_end_once() -> None:
    first = _chunk("a", 0, "x") + _chunk("a", 1, "y") + _usage("a", 4) + b"data: [DONE]\n\n"
    second = _chunk("b", 0, "z") + _chunk("b", 1, "w") + _usage("b", 6) + b"data: [DONE]\n\n"
    # Events cut across chunk boundaries, as they arrive off a socket.
    streams = [
        ChunkStream(first[:30], first[30:]),
        ChunkStream(second[:5], second[5:77], second[77:]),
    ]
    merged = BatchStream(list(streams), choices_per_prompt=2)
    out = b""
    while (chunk := await merged.next_chunk()) is not None:
        out += chunk
        if merged.at_end:
            break
    await merged.aclose()
    assert all(s.closed for s in streams)
    events = [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    data = [orjson.loads(e) for e in events[:-1]]
    assert {d["id"] for d in data} == {"a"}
    assert [(c["index"], c["text"]) for d in data for c in d["choices"]] == [
        (0, "x"), (1, "y"), (2, "z"), (3, "w"),
    ]  # fmt: skip
    assert data[-1]["choices"] == []
    assert data[-1]["usage"]["prompt_tokens"] == 10
    assert data[-1]["usage"]["completion_tokens"] == 4


async def test_one_failed_prompt_fails_the_batch_and_closes_the_others() -> None:
    opened = ChunkStream(_chunk("a", 0, "x"))

    async def ok() -> Reply:
        return Reply(200, stream=opened)

    async def refused() -> Reply:
        return Reply(400, b'{"error": {"message": "too long"}}')

    reply = await serve_batch([ok(), refused()], stream=True, choices_per_prompt=1)
    assert reply.status == 400 and b"too long" in reply.body
    assert opened.closed

    async def broken() -> Reply:
        raise RuntimeError("no engine")

    with pytest.raises(RuntimeError):
        await serve_batch([ok(), broken()], stream=False, choices_per_prompt=1)


async def test_a_non_streamed_batch_holds_a_window_of_engine_requests() -> None:
    """Issue #39, case 2: 2,000 prompts opened 2,000 engine requests at once. A non-streamed
    batch runs at most ``BATCH_WINDOW`` prompts at once, and answers in the batch's order."""
    import asyncio

    from kvturn.gateway.batches import BATCH_WINDOW

    running = peak = 0

    async def prompt(i: int) -> Reply:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (i % 3))
        running -= 1
        body = {"id": "c", "choices": [{"index": 0, "text": str(i)}], "usage": None}
        return Reply(200, orjson.dumps(body))

    reply = await serve_batch([prompt(i) for i in range(200)], stream=False, choices_per_prompt=1)
    choices = orjson.loads(reply.body)["choices"]
    assert [c["text"] for c in choices] == [str(i) for i in range(200)]
    assert peak == BATCH_WINDOW


def test_a_batch_past_the_limit_is_refused() -> None:
    from kvturn.gateway.errors import InvalidRequest
    from kvturn.gateway.validation import MAX_BATCH_PROMPTS, check_request

    check_request("/v1/completions", {"prompt": ["a"] * MAX_BATCH_PROMPTS})
    check_request("/v1/completions", {"prompt": list(range(10_000))})  # one prompt's token ids
    for prompt in (["a"] * (MAX_BATCH_PROMPTS + 1), [[1]] * (MAX_BATCH_PROMPTS + 1)):
        with pytest.raises(InvalidRequest) as refused:
            check_request("/v1/completions", {"prompt": prompt})
        assert refused.value.param == "prompt"
        assert f"at most {MAX_BATCH_PROMPTS} items" in str(refused.value)


@pytest.mark.parametrize(
    "prompt",
    [
        [f"p{i}" for i in range(2000)],  # too many prompts
        [1] * 5000 + ["x"] * 5000,  # token ids, then words
        ["x"] * 200 + [1] * 5000,  # words, then token ids
        [[1]] * 100 + [["x"]] * 5000,  # lists of token ids, then of words
    ],
    ids=["2000 prompts", "ids then words", "words then ids", "id lists then word lists"],
)
def test_a_wrong_prompt_list_is_judged_by_one_form_and_its_first_wrong_item(
    prompt: list[object],
) -> None:
    """One error, not one per item per form of prompt: each error was built on the gateway's
    loop (a 20 MiB batch took 7.7 s to refuse, the gateway stopped meanwhile; issue #39)."""
    from pydantic import ValidationError

    from kvturn.gateway.validation import CompletionRequest

    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"prompt": prompt})
    assert refused.value.error_count() == 1


class _Opened:
    """A prompt's stream that counts itself open (``open``) from its prompt's start until it
    is closed."""

    def __init__(self, counter: dict[str, int], *chunks: bytes):
        self.counter = counter
        self.inner = ChunkStream(*chunks)

    @property
    def at_end(self) -> bool:
        return self.inner.at_end

    async def next_chunk(self) -> bytes | None:
        return await self.inner.next_chunk()

    async def aclose(self) -> None:
        self.counter["open"] -= 1
        await self.inner.aclose()


async def _read_all(reply: Reply) -> list[bytes]:
    assert reply.stream is not None
    out = b""
    while (chunk := await reply.stream.next_chunk()) is not None:
        out += chunk
        if reply.stream.at_end:
            break
    await reply.stream.aclose()
    return [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]


async def test_a_streamed_batch_holds_a_window_of_engine_requests() -> None:
    """A streamed batch of n prompts opened n engine requests at once. Each prompt now takes
    its place in the window before it starts and keeps it until its stream has been relayed;
    the reply is still every prompt's chunks in the batch's order, numbered as vLLM numbers
    them, with one usage chunk and one [DONE]."""
    import asyncio

    counter = {"open": 0, "peak": 0}

    async def prompt(i: int) -> Reply:
        counter["open"] += 1
        counter["peak"] = max(counter["peak"], counter["open"])
        await asyncio.sleep(0.001 * (i % 3))
        stream = _Opened(counter, _chunk(f"p{i}", 0, str(i)), _usage(f"p{i}", 1))
        return Reply(200, stream=stream)

    reply = await serve_batch(
        [prompt(i) for i in range(50)], stream=True, choices_per_prompt=1, window=8
    )
    assert reply.status == 200
    events = await _read_all(reply)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    data = [orjson.loads(e) for e in events[:-1]]
    assert [(c["index"], c["text"]) for d in data for c in d["choices"]] == [
        (i, str(i)) for i in range(50)
    ]
    assert data[-1]["usage"]["prompt_tokens"] == 50
    assert counter["peak"] == 8
    assert counter["open"] == 0  # every prompt's stream closed


async def test_a_prompt_failing_after_the_first_window_ends_the_stream_with_an_error() -> None:
    """The first window's replies decide the reply's status; a prompt after it that fails
    can only end the stream that started: an error event, then [DONE], as vLLM ends a stream
    that failed; the prompts after it never start."""
    started: list[int] = []
    first = ChunkStream(_chunk("a", 0, "x"), _usage("a", 4))

    async def ok() -> Reply:
        started.append(0)
        return Reply(200, stream=first)

    async def refused() -> Reply:
        started.append(1)
        body = {"error": {"message": "prompt too long", "type": "BadRequestError",
                          "param": None, "code": 400}}  # fmt: skip
        return Reply(400, orjson.dumps(body))

    async def never() -> Reply:
        started.append(2)
        return Reply(200, stream=ChunkStream(_chunk("c", 0, "z")))

    reply = await serve_batch([ok(), refused(), never()], stream=True, choices_per_prompt=1,
                              window=1)  # fmt: skip
    assert reply.status == 200
    events = await _read_all(reply)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    assert orjson.loads(events[0])["choices"][0]["text"] == "x"
    assert orjson.loads(events[1])["error"]["message"] == "prompt too long"
    assert len(events) == 3  # no usage chunk: the batch did not finish
    assert started == [0, 1] and first.closed == 1


async def test_a_streamed_batch_whose_client_left_calls_off_every_prompt() -> None:
    """Closed part-way (its client left): the prompts under way are cancelled, those not
    started never start, every stream opened is closed once, and the window's places are
    all given back."""
    import asyncio

    counter = {"open": 0, "peak": 0}
    cancelled: list[int] = []
    started: list[int] = []

    async def prompt(i: int) -> Reply:
        started.append(i)
        if i == 5:
            try:
                await asyncio.Event().wait()  # an engine that never answers
            except asyncio.CancelledError:
                cancelled.append(i)
                raise
        counter["open"] += 1
        return Reply(200, stream=_Opened(counter, _chunk(f"p{i}", 0, str(i))))

    reply = await serve_batch(
        [prompt(i) for i in range(20)], stream=True, choices_per_prompt=1, window=4
    )
    assert reply.stream is not None
    relayed = b""
    while b'"text":"4"' not in relayed:  # prompts 0-3 relayed and closed: 4-7 started
        relayed += await reply.stream.next_chunk() or b""
    await reply.stream.aclose()
    assert cancelled == [5]
    assert counter["open"] == 0
    assert sorted(started) == list(range(8))  # prompts past the window never started


@pytest.mark.parametrize("stream", [False, True])
async def test_batches_share_the_gateways_lane(stream: bool) -> None:
    """Prompts of every batch together run no more at once than the lane's limit (here 2,
    as a late loop would leave it), across two batches whose windows would allow 16; each
    still progresses, and the answers are unchanged."""
    import asyncio

    from kvturn.gateway.congestion import BulkLane

    lane = BulkLane(ceiling=2)
    counter = {"open": 0}
    running = peak = 0
    started: dict[str, int] = {"a": 0, "b": 0}

    async def prompt(batch: str, i: int) -> Reply:
        nonlocal running, peak
        started[batch] += 1
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        running -= 1
        if stream:
            counter["open"] += 1
            text = f"{batch}{i}"
            return Reply(200, stream=_Opened(counter, _chunk(text, 0, text), _usage("u", 1)))
        return Reply(200, orjson.dumps({"choices": [{"index": 0, "text": f"{batch}{i}"}]}))

    async def batch(name: str) -> list[str]:
        reply = await serve_batch(
            [prompt(name, i) for i in range(12)], stream=stream, choices_per_prompt=1,
            window=8, lane=lane,
        )  # fmt: skip
        if stream:
            events = await _read_all(reply)
            return [c["text"] for e in events[:-1] for c in orjson.loads(e)["choices"]]
        return [c["text"] for c in orjson.loads(reply.body)["choices"]]

    a, b = await asyncio.gather(batch("a"), batch("b"))
    assert a == [f"a{i}" for i in range(12)] and b == [f"b{i}" for i in range(12)]
    assert peak == 2
    assert lane.running == 0


async def test_the_lane_halves_when_the_loop_is_late_and_grows_back_slowly() -> None:
    import asyncio

    from kvturn.gateway.congestion import BulkLane

    lane = BulkLane(ceiling=16)
    lane.sampled(late=True)
    assert lane.limit == 16  # nothing running: a late loop is not the batches' doing
    for _ in range(16):
        await lane.acquire()
    for expected in (8, 4, 2, 1, 1):
        lane.sampled(late=True)
        assert lane.limit == expected  # never under one: batches still progress
    lane.sampled(late=False)
    assert lane.limit == 1  # nobody waiting: no growth
    waiting = [asyncio.ensure_future(lane.acquire()) for _ in range(40)]
    await asyncio.sleep(0)
    lane.sampled(late=False)
    assert lane.limit == 2  # one more a limit's worth of on-time samples...
    lane.sampled(late=False)
    assert lane.limit == 2  # ...2.5
    for _ in range(500):
        lane.sampled(late=False)
    assert lane.limit == 16  # never past the ceiling
    for each in waiting:
        each.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert lane.running == 16


async def test_the_lane_narrows_only_while_turns_are_under_way() -> None:
    """A batch alone has nobody to yield to: a late loop (on a machine the engines share,
    their own work makes it late) leaves its lane wide. Measured on this machine's engine
    pair, a 64-prompt batch alone took 1.9 s with the lane narrowing anyway, 0.7-0.9 s
    without."""
    from kvturn.gateway.congestion import BulkLane

    turns = 0
    lane = BulkLane(ceiling=16, contended=lambda: turns > 0)
    for _ in range(16):
        await lane.acquire()
    lane.sampled(late=True)
    assert lane.limit == 16
    turns = 1
    lane.sampled(late=True)
    assert lane.limit == 8


@pytest.mark.parametrize(("cpu_share", "narrows"), [(0.8, True), (0.2, False)])
async def test_a_busy_gateway_narrows_the_lane_though_its_loop_is_on_time(
    cpu_share: float, narrows: bool
) -> None:
    """The loop's timer can fire on time while the process spends most of its time on
    batches' requests (measured: 9% of samples late, 0.8 of a core busy, A's p99 doubled):
    past half a core, averaged over recent samples, the loop counts as behind."""
    import asyncio

    from kvturn.gateway.congestion import BulkLane, LoopLag

    loop = asyncio.get_running_loop()
    # The process's CPU time, as a share of the loop's time since the test began.
    began = loop.time()
    lag = LoopLag(sample_s=0.002, late_s=10.0, cpu_clock=lambda: (loop.time() - began) * cpu_share)
    lane = BulkLane(ceiling=16)
    for _ in range(16):
        await lane.acquire()
    watching = asyncio.ensure_future(lag.watch(lane))
    await asyncio.sleep(0.1)
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    assert not lag.late
    assert lag.busy == pytest.approx(cpu_share, abs=0.1)
    assert lag.behind is narrows
    assert (lane.limit == 1) is narrows


def test_a_request_counts_as_a_turn_until_it_widens_as_a_batch() -> None:
    from kvturn.gateway.callers import CallerLimits

    limits = CallerLimits(requests=0, engine_requests=0)
    turn, batch = limits.admit("a"), limits.admit("b")
    assert limits.turns_in_flight == 2
    batch.widen(8)
    assert limits.turns_in_flight == 1
    batch.release()
    batch.release()  # once only
    assert (limits.in_flight, limits.batches, limits.turns_in_flight) == (1, 0, 1)
    turn.release()
    assert (limits.in_flight, limits.turns_in_flight) == (0, 0)


async def test_a_prompt_called_off_in_the_lane_leaves_it_as_it_was() -> None:
    """A prompt waiting for its place and called off takes none; one called off just as
    it was given a place passes it on: the lane never leaks a place."""
    import asyncio

    from kvturn.gateway.congestion import BulkLane

    lane = BulkLane(ceiling=1)
    await lane.acquire()
    waiting = [asyncio.ensure_future(lane.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    waiting[0].cancel()  # called off while it waits
    lane.release()  # the place goes to the next one waiting, not the one called off
    await asyncio.sleep(0)
    assert waiting[1].done() and not waiting[1].cancelled()
    assert lane.running == 1
    lane.release()
    waiting[2].cancel()  # given the place, then called off before it ran: passed on
    await asyncio.gather(*waiting, return_exceptions=True)
    assert lane.running == 0 and not lane._waiting
    await lane.acquire()  # and the lane still serves
    assert lane.running == 1


async def test_a_batch_runs_through_a_window_of_tasks_not_one_per_prompt() -> None:
    """256 prompts, a window of 4: at most 4 tasks of the batch exist at once (a task per
    prompt, all made at once, queued every other caller's next step behind them)."""
    import asyncio

    from kvturn.gateway.batches import windowed

    tasks_seen = 0
    baseline = len(asyncio.all_tasks())

    async def prompt(i: int) -> Reply:
        nonlocal tasks_seen
        tasks_seen = max(tasks_seen, len(asyncio.all_tasks()) - baseline)
        await asyncio.sleep(0)
        return Reply(200, str(i).encode())

    replies = await windowed([prompt(i) for i in range(256)], 4)
    assert [r.body for r in replies if isinstance(r, Reply)] == [
        str(i).encode() for i in range(256)
    ]
    assert tasks_seen == 4
