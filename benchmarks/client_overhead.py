"""What kvturn.client adds to each request, against the plain openai client.

Both clients talk to an in-process ``httpx2.MockTransport`` (the HTTP library openai 3.x is
built on) that answers a canned chat completion, so the network and the server are out of the
measurement and what remains is client-side work. Single requests of the two clients alternate
and each is timed in thread CPU time, so other processes on a shared machine hardly matter; an
A/A comparison of two plain clients shows the noise floor. kvturn's own hooks are also timed
directly. Results go to ``benchmarks/results/client_overhead.md``.

    .venv/bin/python benchmarks/client_overhead.py [--pairs 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import openai

import kvturn.client

BASE_URL = "http://bench.invalid/v1"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _chunk(delta: dict[str, Any], finish: str | None) -> str:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


SSE = (
    _chunk({"role": "assistant", "content": ""}, None)
    + "".join(_chunk({"content": w}, None) for w in ("a ", "b ", "c "))
    + _chunk({}, "stop")
    + "data: [DONE]\n\n"
).encode()
HEADERS = {"X-Kvturn-Lease-Seconds": "30", "X-Kvturn-Plan": "decode-local"}


def handler(request: httpx2.Request) -> httpx2.Response:
    if b'"stream":true' in request.content.replace(b" ", b""):
        return httpx2.Response(
            200, content=SSE, headers={**HEADERS, "content-type": "text/event-stream"}
        )
    return httpx2.Response(200, json=COMPLETION, headers=HEADERS)


class HeadersOnly(openai.OpenAI):
    """The plain client carrying the four turn headers and nothing else of kvturn: what the
    SDK and httpx2 themselves spend on the extra headers."""

    def _prepare_request(self, request: httpx2.Request) -> None:
        super()._prepare_request(request)
        for key, value in TURN_HEADERS.items():
            request.headers[key] = value


TURN_HEADERS = {
    "X-Conversation-Id": "bench",
    "X-Kvturn-Turn-Id": "0" * 32,
    "X-Kvturn-Pause-Ms": "12",
    "X-Kvturn-Pause-Kind": "tool",
}


def make(cls: type[Any], **kwargs: Any) -> Any:
    return cls(
        base_url=BASE_URL,
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        **kwargs,
    )


def make_async(cls: type[Any], **kwargs: Any) -> Any:
    return cls(
        base_url=BASE_URL,
        api_key="x",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
        **kwargs,
    )


Request = Callable[[], Any]


def timed_sync(call: Request) -> float:
    """Thread CPU µs of one request: other processes on the machine do not count."""
    start = time.thread_time_ns()
    call()
    return (time.thread_time_ns() - start) / 1000


def sync_request(client: Any, *, stream: bool) -> Request:
    def call() -> None:
        if stream:
            for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        else:
            client.chat.completions.create(model="m", messages=MESSAGES)

    return call


def paired_sync(a: Request, b: Request, pairs: int) -> list[float]:
    """Per-pair differences b - a, alternating single requests so drift hits both alike."""
    for _ in range(50):
        a(), b()
    diffs = []
    for i in range(pairs):
        if i % 2:
            tb, ta = timed_sync(b), timed_sync(a)
        else:
            ta, tb = timed_sync(a), timed_sync(b)
        diffs.append(tb - ta)
    return diffs


def summarize(diffs: list[float]) -> tuple[float, float, float]:
    """Mean, its standard error, and the median of the paired differences."""
    mean = statistics.fmean(diffs)
    sem = statistics.stdev(diffs) / len(diffs) ** 0.5
    return mean, sem, statistics.median(diffs)


def hook_cost(iterations: int) -> float:
    """CPU µs of kvturn's own per-request work, timed directly: turn start (pause clock, turn
    id, headers), tagging the HTTP request, reading the response headers, turn end (tool
    check, beat planning)."""
    from openai._models import FinalRequestOptions
    from openai.types.chat import ChatCompletion

    from kvturn.client._base import sending_turn
    from kvturn.client._replies import asks_for_tools

    client = kvturn.client.OpenAI(base_url=BASE_URL, api_key="x")
    reply = ChatCompletion.model_validate(COMPLETION)
    response_headers = httpx2.Headers(
        {**HEADERS, "content-type": "application/json", "content-length": "200", "date": "-"}
    )
    # What the SDK's own headers on a request look like (about a dozen).
    request = client._build_request(
        FinalRequestOptions.construct(method="post", url="/chat/completions", json_data={})
    )
    sdk_headers = request.headers.copy()
    options = FinalRequestOptions.construct(
        method="post", url="/chat/completions", json_data={"model": "m", "messages": MESSAGES}
    )
    with client.conversation("hooks"):

        def one() -> None:
            turn = client._kvturn_begin(options)
            assert turn is not None
            token = sending_turn.set(turn)
            request.headers = sdk_headers.copy()
            client._kvturn_tag(request)
            client._kvturn_observe(turn, response_headers)
            sending_turn.reset(token)
            client._kvturn_finish(turn, tool_calls=asks_for_tools(reply))

        for _ in range(1000):
            one()
        start = time.process_time_ns()
        for _ in range(iterations):
            one()
        cost = (time.process_time_ns() - start) / iterations / 1000
    client.close()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="request pairs per comparison")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "client_overhead.md"
    )
    args = parser.parse_args()

    plain = make(openai.OpenAI)
    plain2 = make(openai.OpenAI)
    kv = make(kvturn.client.OpenAI)
    kv_outside = kv.with_options()
    loop = asyncio.new_event_loop()
    aplain = make_async(openai.AsyncOpenAI)
    akv = make_async(kvturn.client.AsyncOpenAI)

    base = statistics.median(timed_sync(sync_request(plain, stream=False)) for _ in range(200))
    base_stream = statistics.median(
        timed_sync(sync_request(plain, stream=True)) for _ in range(200)
    )
    # The outside case runs in a fresh context, where no conversation is current.
    outside = contextvars.Context().run(
        paired_sync,
        sync_request(plain, stream=False),
        sync_request(kv_outside, stream=False),
        args.pairs,
    )
    headers_only = paired_sync(
        sync_request(plain, stream=False),
        sync_request(make(HeadersOnly), stream=False),
        args.pairs,
    )
    # One conversation spans each run: what is timed is the per-request work (headers, pause
    # clock, stream wrapper, beat planning), not opening and releasing conversations.
    with kv.conversation("bench") as conversation:
        aa = paired_sync(
            sync_request(plain, stream=False), sync_request(plain2, stream=False), args.pairs
        )
        inside = paired_sync(
            sync_request(plain, stream=False), sync_request(kv, stream=False), args.pairs
        )
        streamed = paired_sync(
            sync_request(plain, stream=True), sync_request(kv, stream=True), args.pairs
        )
        turns = conversation.turn_count

    async def in_conversation() -> tuple[list[float], float]:
        async with akv.conversation("bench-async"):
            return await paired_async(aplain, akv, args.pairs)

    adiffs, abase = loop.run_until_complete(in_conversation())
    results: list[tuple[str, float, tuple[float, float, float]]] = [
        ("A/A: plain openai vs plain openai (noise floor)", base, summarize(aa)),
        ("plain openai + the 4 turn headers, no kvturn code", base, summarize(headers_only)),
        ("kvturn, outside a conversation", base, summarize(outside)),
        ("kvturn, in a conversation", base, summarize(inside)),
        ("kvturn, in a conversation, streamed (5 chunks)", base_stream, summarize(streamed)),
        ("AsyncOpenAI kvturn, in a conversation", abase, summarize(adiffs)),
    ]
    hooks = hook_cost(20000)

    lines = [
        "# kvturn.client per-request overhead",
        "",
        f"`benchmarks/client_overhead.py --pairs {args.pairs}`. Both clients talk to an "
        "in-process `httpx2.MockTransport` (openai 3.x is built on httpx2), so no network or "
        "server time is included. Each comparison alternates single requests of the plain "
        "openai client and the kvturn client and records the CPU time of the calling thread "
        "per request (robust to other processes on this shared 2-core machine); the table "
        "gives the mean paired difference ± its standard error, and the median. "
        f"Python {platform.python_version()}, openai {openai.__version__}, "
        f"{platform.machine()}.",
        "",
        "| comparison | plain µs / request (median) | added µs / request: mean ± s.e. | median |",
        "|---|---:|---:|---:|",
    ]
    for name, baseline, (mean, sem, median) in results:
        lines.append(f"| {name} | {baseline:.0f} | {mean:+.1f} ± {sem:.1f} | {median:+.1f} |")
    lines += [
        "",
        f"kvturn's own per-request work timed directly (turn start, tagging the request, "
        f"response headers, turn end with beat planning; process CPU, 20,000 iterations, hot "
        f"caches): **{hooks:.1f} µs**. Target: under 50 µs added per request.",
        "",
        "Reading it: the A/A row is the noise floor. The headers-only row is what the SDK and "
        "httpx2 spend carrying four more headers, before any kvturn code runs. In a real "
        "request kvturn's code runs between ~1.5 ms of SDK work, with cold caches, on a "
        "sandboxed 2-core machine shared with two vLLM engines, so the in-request difference "
        "is larger than the hot, direct timing. Streams pay per chunk for the tool-call check "
        "and the wrapper generator. Relative to the SDK's own cost per request the added "
        "time is a few per cent.",
        "",
        f"Turns recorded in the sync conversation: {turns}.",
        "",
    ]
    report = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    for client in (plain, plain2, kv):
        client.close()
    loop.run_until_complete(aplain.close())
    loop.run_until_complete(akv.close())
    loop.close()


async def paired_async(a: Any, b: Any, pairs: int) -> tuple[list[float], float]:
    """The async twin of :func:`paired_sync`; also returns the plain client's median."""

    async def one(client: Any) -> float:
        start = time.thread_time_ns()
        await client.chat.completions.create(model="m", messages=MESSAGES)
        return (time.thread_time_ns() - start) / 1000

    for _ in range(50):
        await one(a), await one(b)
    diffs, base = [], []
    for i in range(pairs):
        if i % 2:
            tb, ta = await one(b), await one(a)
        else:
            ta, tb = await one(a), await one(b)
        diffs.append(tb - ta)
        base.append(ta)
    return diffs, statistics.median(base)


if __name__ == "__main__":
    main()
