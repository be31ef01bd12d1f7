"""What kvturn.client adds to each request, against the plain openai client.

Every client talks to an in-process ``MockTransport`` of the HTTP library the installed openai
is built on (httpx2 for openai 3.x, httpx before) that answers a canned chat completion or
stream (each event its own chunk of the body, as a server flushing tokens sends them; a
completion as a body read from the wire, not one handed over whole), so the network and the
server are out of the measurement and what remains is client-side work, end to end through the
SDK.

Method, chosen so that an A/A comparison of two identical plain clients reads ~0:

* Each comparison is a series of pairs: one request of the plain client (A) and one of the
  client under test (B), in random order within the pair (a fair coin per pair). The figure
  is the mean of the per-pair differences B - A, with its standard error. Each comparison has
  clients of its own, so both sides are equally warm when their turn comes.
* The comparisons take turns: each round runs a block of consecutive pairs (50) of every
  comparison, the comparisons in random order, so all of them sample the whole run (a shared
  2-core sandbox whose speed drifts by tens of per cent over a minute), while within a block
  the two clients alternate as an application making requests in a row would.
* Time is the process's CPU time (``time.process_time_ns``: every thread of this process, so
  work a client hands to a background thread would count; other processes do not).
* Every client is warmed up before timing. Objects alive after set-up are frozen out of the
  garbage collector's view (``gc.freeze``), and a full collection runs before each block,
  never inside a timed request; the young-generation collections that a request's own
  allocations trigger stay on, for both clients alike.

* The pairs are split between several fresh processes, run one after another. A process's
  memory layout decides which attribute look-ups collide in CPython's type-attribute cache (a
  type's version tag XOR the name's address): a client class can pay tens of thousands of
  instructions more per request in one layout than in the next (measured with cachegrind: an
  empty subclass of ``openai.OpenAI`` cost +36k instructions per streamed request in one
  layout and +4k in another). One process samples one layout; several average over them.
* The sync comparisons and the async ones run in processes of their own (``--mix`` runs them
  all in each process), as an application uses one client or the other: interleaved in one
  process, the two clients' code keeps pushing each other's out of the caches, and every
  request, plain or not, took 30 to 40 % longer (kvturn's added cost up to 1.6 times more).

Streamed rows come as plain text and as a tool call (the watch for tool calls parses the
events that hold one). kvturn's own per-request work is also timed in a hot loop, to show how
much of its in-request cost comes from running amid the SDK's work with cold caches. Results
go to ``benchmarks/results/client_overhead.md`` (the text after its "Reading it" heading is
kept when the table is regenerated).

    .venv/bin/python benchmarks/client_overhead.py [--pairs 4000] [--client-dir DIR] [--mix]

``--client-dir`` measures another version of the client package with this same method, for
before/after comparisons, e.g. ``git archive <commit> client | tar -x -C /tmp/old`` and then
``--client-dir /tmp/old/client --out /tmp/old.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import importlib.util
import json
import math
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

import kvturn.client

try:
    import httpx2
except ImportError:  # openai 1.x and 2.x are built on httpx alone
    httpx2 = None

#: The HTTP library the installed openai is built on.
http: Any = (
    httpx2 if httpx2 is not None and issubclass(openai.DefaultHttpxClient, httpx2.Client) else httpx
)

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
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"  # compact, as vLLM sends


#: A streamed reply: its events, each its own network chunk (as a server flushing each token
#: sends them), and the end marker.
SSE_EVENTS = [
    _chunk({"role": "assistant", "content": ""}, None).encode(),
    *(_chunk({"content": w}, None).encode() for w in ("a ", "b ", "c ")),
    _chunk({}, "stop").encode(),
    b"data: [DONE]\n\n",
]
STREAM_CHUNKS = len(SSE_EVENTS) - 1
_CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
#: A streamed reply that calls a tool (what an agent's turns mostly end with), as many chunks.
SSE_TOOL_EVENTS = [
    _chunk({"role": "assistant", "tool_calls": [_CALL]}, None).encode(),
    *(
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}, None).encode()
        for a in ('{"q": ', '"x"', "}")
    ),
    _chunk({}, "tool_calls").encode(),
    b"data: [DONE]\n\n",
]
#: Requests that carry tools get the tool-calling stream.
TOOLS: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
#: What the kvturn gateway says on every answer of a conversation.
HEADERS = {"X-Kvturn-Lease-Seconds": "30", "X-Kvturn-Plan": "pull-reuse"}
#: The four headers kvturn adds, as a caller of the plain client would add them.
TURN_HEADERS = {
    "X-Conversation-Id": "bench",
    "X-Kvturn-Turn-Id": "0" * 32,
    "X-Kvturn-Pause-Ms": "12",
    "X-Kvturn-Pause-Kind": "tool",
}


SSE_HEADERS = {**HEADERS, "content-type": "text/event-stream"}
JSON_HEADERS = {**HEADERS, "content-type": "application/json"}
COMPLETION_BODY = json.dumps(COMPLETION).encode()


def _stream_events(request: Any) -> list[bytes] | None:
    content = request.content.replace(b" ", b"")
    if b'"stream":true' not in content:
        return None
    return SSE_TOOL_EVENTS if b'"tools":' in content else SSE_EVENTS


def handler(request: Any) -> Any:
    events = _stream_events(request)
    if events is not None:
        return http.Response(200, content=iter(events), headers=SSE_HEADERS)
    return http.Response(200, content=iter([COMPLETION_BODY]), headers=JSON_HEADERS)


async def _events(events: list[bytes]) -> Any:
    for event in events:
        yield event


def async_handler(request: Any) -> Any:
    events = _stream_events(request)
    if events is not None:
        return http.Response(200, content=_events(events), headers=SSE_HEADERS)
    return http.Response(200, content=_events([COMPLETION_BODY]), headers=JSON_HEADERS)


def make(cls: type[Any], **kwargs: Any) -> Any:
    return cls(
        base_url=BASE_URL,
        api_key="x",
        max_retries=0,
        http_client=http.Client(transport=http.MockTransport(handler)),
        **kwargs,
    )


def make_async(cls: type[Any], **kwargs: Any) -> Any:
    return cls(
        base_url=BASE_URL,
        api_key="x",
        max_retries=0,
        http_client=http.AsyncClient(transport=http.MockTransport(async_handler)),
        **kwargs,
    )


Request = Callable[[], Any]

#: The comparisons of each client kind (by name), run in processes of their own by default.
SYNC_ROWS = r"^(A/A: |plain openai|kvturn)"
ASYNC_ROWS = r"(?i)async"
clock = time.process_time_ns


def sync_request(
    client: Any, *, stream: bool, headers: dict[str, str] | None = None, tools: bool = False
) -> Request:
    """One request (and the whole stream), returning the µs of CPU time it took."""
    extra: dict[str, Any] = {"tools": TOOLS} if tools else {}

    def call() -> float:
        start = clock()
        if stream:
            for _ in client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, extra_headers=headers, **extra
            ):
                pass
        else:
            client.chat.completions.create(model="m", messages=MESSAGES, extra_headers=headers)
        return (clock() - start) / 1000

    return call


def async_request(
    client: Any,
    loop: asyncio.AbstractEventLoop,
    context: contextvars.Context,
    *,
    stream: bool,
    tools: bool = False,
) -> Request:
    """The async twin: the request runs as a task in ``context`` (where its conversation is
    open); only the awaited request is timed, not the loop's task set-up."""
    extra: dict[str, Any] = {"tools": TOOLS} if tools else {}

    async def one() -> float:
        start = clock()
        if stream:
            async for _ in await client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, **extra
            ):
                pass
        else:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        return (clock() - start) / 1000

    def call() -> float:
        return loop.run_until_complete(loop.create_task(one(), context=context))

    return call


def in_context(context: contextvars.Context, call: Request) -> Request:
    return lambda: context.run(call)


@dataclass
class Comparison:
    name: str
    plain: Request
    other: Request
    diffs: list[float] = field(default_factory=list)
    plain_us: list[float] = field(default_factory=list)
    #: Each process's mean difference (pooled comparisons only).
    process_means: list[float] = field(default_factory=list)

    def pair(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            a = self.plain()
            b = self.other()
        else:
            b = self.other()
            a = self.plain()
        self.diffs.append(b - a)
        self.plain_us.append(a)

    def row(self) -> str:
        mean = statistics.fmean(self.diffs)
        sem = statistics.stdev(self.diffs) / len(self.diffs) ** 0.5
        median = statistics.median(self.diffs)
        base = statistics.median(self.plain_us)
        # Relative to the plain request, pair by pair: the sandbox's speed drifts (a plain
        # request's cost moved between 1.2 and 3.2 ms across runs), and what kvturn adds
        # scales with it.
        relative = statistics.fmean(d / a for d, a in zip(self.diffs, self.plain_us, strict=True))
        spread = ""
        if len(self.process_means) > 1:
            low, high = min(self.process_means), max(self.process_means)
            spread = f" | {low:+.0f} … {high:+.0f}"
        return (
            f"| {self.name} | {base:.0f} | {mean:+.1f} ± {sem:.1f} | {median:+.1f} "
            f"| {100 * relative:+.2f}%{spread} |"
        )


def run(comparisons: list[Comparison], pairs: int, block: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    for comparison in comparisons:  # warm-up: caches, lazy imports, the SDK's own set-up
        for _ in range(100):
            comparison.plain()
            comparison.other()
    gc.collect()
    gc.freeze()
    order = list(comparisons)
    done = 0
    while done < pairs:
        size = min(block, pairs - done)
        rng.shuffle(order)
        for comparison in order:
            gc.collect()  # between blocks, never inside a timed request
            for _ in range(size):
                comparison.pair(rng)
        done += size
    gc.unfreeze()


def hook_cost(iterations: int) -> float:
    """CPU µs of kvturn's own per-request work in a hot loop: what its HTTP client hooks do
    to one request and its answer (turn start, the turn's headers on the request, the answer's
    headers, the watched body read and closed, turn end with beat planning), less the same
    loop without them (making, reading and closing the request and response)."""
    from kvturn.client._hooks import attempt_answered, attempt_started

    client = make(kvturn.client.OpenAI, heartbeats=False)
    # About the dozen headers the SDK puts on a request.
    sdk_headers = {
        "Accept": "application/json",
        "Content-Type": "application/json",
        "User-Agent": "OpenAI/Python bench",
        "Authorization": "Bearer x",
        **{f"X-Stainless-{name}": "x" for name in ("Lang", "Package-Version", "OS", "Arch")},
        **{f"X-Stainless-{name}": "x" for name in ("Runtime", "Runtime-Version", "Async")},
        "x-stainless-retry-count": "0",
    }

    def one(hooked: bool) -> None:
        request = http.Request("POST", BASE_URL + "/chat/completions", headers=sdk_headers)
        if hooked:
            attempt_started(request)
        response = http.Response(
            200, content=iter([COMPLETION_BODY]), headers=JSON_HEADERS, request=request
        )
        if hooked:
            attempt_answered(response, False)
        response.read()

    def timed(hooked: bool) -> float:
        for _ in range(1000):
            one(hooked)
        start = time.process_time_ns()
        for _ in range(iterations):
            one(hooked)
        return (time.process_time_ns() - start) / iterations / 1000

    with client.conversation("hooks"):
        cost = min(timed(True) for _ in range(3)) - min(timed(False) for _ in range(3))
    client.close()
    return cost


def use_client_from(directory: Path) -> None:
    """Make ``kvturn.client`` the package in ``directory`` (another ``kvturn/client/``)."""
    for name in [n for n in sys.modules if n == "kvturn.client" or n.startswith("kvturn.client.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "kvturn.client", directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["kvturn.client"] = package
    spec.loader.exec_module(package)
    kvturn.client = package  # type: ignore[attr-defined]


def measure(pairs: int, block: int, seed: int, only: str | None = None) -> dict[str, Any]:
    """Run every comparison in this process; their per-pair figures and the turn counts."""
    loop = asyncio.new_event_loop()
    # Every comparison has clients of its own, so the two sides of a pair are alike in how
    # recently their objects were used (a client shared by several comparisons would be warmer
    # than its partner at the start of each block).
    sync_clients: list[Any] = []
    async_clients: list[Any] = []

    def client(cls: type[Any]) -> Any:
        made = make(cls)
        sync_clients.append(made)
        return made

    def aclient(cls: type[Any]) -> Any:
        made = make_async(cls)
        async_clients.append(made)
        return made

    # Each in-conversation case runs in a context of its own where one conversation spans the
    # whole run, so what is timed is the per-request work (headers, pause clock, stream
    # tracking, beat planning), not opening and releasing conversations.
    outside = contextvars.Context()
    scopes: list[tuple[contextvars.Context, Any]] = []
    ascopes: list[tuple[contextvars.Context, Any]] = []
    conversations: list[Any] = []

    def conversation(kv: Any, name: str) -> contextvars.Context:
        context = contextvars.copy_context()
        scope = kv.conversation(name)
        scopes.append((context, scope))
        conversations.append(context.run(scope.__enter__))
        return context

    def aconversation(kv: Any, name: str) -> contextvars.Context:
        context = contextvars.copy_context()
        scope = kv.conversation(name)
        ascopes.append((context, scope))
        entered = loop.create_task(scope.__aenter__(), context=context)
        conversations.append(loop.run_until_complete(entered))
        return context

    def sync(plain: Any, other: Any, context: contextvars.Context, **kwargs: Any) -> Any:
        headers = kwargs.pop("headers", None)
        return (
            in_context(context, sync_request(plain, **kwargs)),
            in_context(context, sync_request(other, headers=headers, **kwargs)),
        )

    def asyn(plain: Any, other: Any, context: contextvars.Context, **kwargs: Any) -> Any:
        return (
            async_request(plain, loop, context, **kwargs),
            async_request(other, loop, context, **kwargs),
        )

    def kv_sync(name: str) -> tuple[Any, contextvars.Context]:
        kv = client(kvturn.client.OpenAI)
        return kv, conversation(kv, name)

    def kv_async(name: str) -> tuple[Any, contextvars.Context]:
        kv = aclient(kvturn.client.AsyncOpenAI)
        return kv, aconversation(kv, name)

    plain, plain_async = openai.OpenAI, openai.AsyncOpenAI
    chunks = f"{STREAM_CHUNKS} chunks"
    rows = [
        (
            "A/A: plain openai vs plain openai (noise floor)",
            sync(client(plain), client(plain), outside, stream=False),
        ),
        (
            "plain openai + the 4 turn headers as `extra_headers`, no kvturn code",
            sync(client(plain), client(plain), outside, stream=False, headers=TURN_HEADERS),
        ),
        (
            "kvturn, outside a conversation",
            sync(client(plain), client(kvturn.client.OpenAI), outside, stream=False),
        ),
        ("kvturn, in a conversation", sync(client(plain), *kv_sync("c"), stream=False)),
        (
            f"kvturn, in a conversation, streamed ({chunks})",
            sync(client(plain), *kv_sync("s"), stream=True),
        ),
        (
            f"kvturn, in a conversation, streamed, a tool call ({chunks})",
            sync(client(plain), *kv_sync("t"), stream=True, tools=True),
        ),
        (
            "A/A async: plain AsyncOpenAI vs plain AsyncOpenAI",
            asyn(aclient(plain_async), aclient(plain_async), outside, stream=False),
        ),
        (
            "AsyncOpenAI kvturn, in a conversation",
            asyn(aclient(plain_async), *kv_async("ac"), stream=False),
        ),
        (
            f"AsyncOpenAI kvturn, in a conversation, streamed ({chunks})",
            asyn(aclient(plain_async), *kv_async("as"), stream=True),
        ),
        (
            f"AsyncOpenAI kvturn, in a conversation, streamed, a tool call ({chunks})",
            asyn(aclient(plain_async), *kv_async("at"), stream=True, tools=True),
        ),
    ]
    if only is not None:  # (every client is made all the same: the process looks alike)
        rows = [row for row in rows if re.search(only, row[0])]
    comparisons = [Comparison(name, plain_call, other) for name, (plain_call, other) in rows]
    run(comparisons, pairs, block, seed)
    result = {
        "rows": [{"name": c.name, "diffs": c.diffs, "plain_us": c.plain_us} for c in comparisons],
        "turns": [conversation.turn_count for conversation in conversations],
    }
    for context, scope in scopes:
        context.run(scope.__exit__, None, None, None)
    for context, ascope in ascopes:
        loop.run_until_complete(
            loop.create_task(ascope.__aexit__(None, None, None), context=context)
        )
    for made in sync_clients:
        made.close()
    for amade in async_clients:
        loop.run_until_complete(amade.close())
    loop.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4000, help="request pairs per comparison")
    parser.add_argument(
        "--block", type=int, default=50, help="consecutive pairs of one comparison per turn"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="fresh processes the pairs are split between, one after another (see the docstring)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "client_overhead.md"
    )
    parser.add_argument(
        "--client-dir", type=Path, help="measure the client package in this directory instead"
    )
    parser.add_argument(
        "--only", help="run only the comparisons whose name matches this regular expression"
    )
    parser.add_argument(
        "--mix", action="store_true", help="run sync and async comparisons in the same processes"
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # seed; prints JSON
    args = parser.parse_args()
    if args.client_dir is not None:
        use_client_from(args.client_dir.resolve())
    if args.child is not None:
        json.dump(measure(args.pairs, args.block, args.child, args.only), sys.stdout)
        return

    started = time.monotonic()
    per_process = math.ceil(args.pairs / args.processes)
    pooled: dict[str, Comparison] = {}
    turns: list[int] = []
    # By default the sync and the async comparisons run in processes of their own (as an
    # application uses one of the two clients); --mix runs them all in each process.
    groups: list[str | None] = [args.only] if args.only or args.mix else [SYNC_ROWS, ASYNC_ROWS]
    for group in groups:
        for index in range(args.processes):
            command = [sys.executable, __file__, "--pairs", str(per_process)]
            command += ["--block", str(args.block), "--child", str(index + 1)]
            if args.client_dir is not None:
                command += ["--client-dir", str(args.client_dir)]
            if group is not None:
                command += ["--only", group]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            measured = json.loads(done.stdout)
            for row in measured["rows"]:
                pooled.setdefault(row["name"], Comparison(row["name"], _unused, _unused))
                pooled[row["name"]].diffs += row["diffs"]
                pooled[row["name"]].plain_us += row["plain_us"]
                pooled[row["name"]].process_means.append(statistics.fmean(row["diffs"]))
            turns += measured["turns"]
            print(f"{group or 'all'}: process {index + 1}/{args.processes} done", file=sys.stderr)
    elapsed = time.monotonic() - started
    try:
        hooks = hook_cost(20000)
    except (ImportError, AttributeError, TypeError):  # another version's internals
        hooks = math.nan

    pairs = per_process * args.processes
    lines = [
        "# kvturn.client per-request overhead",
        "",
        f"`benchmarks/client_overhead.py --pairs {args.pairs} --block {args.block} "
        f"--processes {args.processes}"
        f"{'' if args.client_dir is None else f' --client-dir {args.client_dir}'}"
        f"{'' if args.only is None else f' --only {args.only!r}'}"
        f"{' --mix' if args.mix else ''}`: "
        f"{pairs} request pairs per comparison, made by {args.processes} fresh processes one "
        f"after another"
        + ("" if len(groups) == 1 else " for the sync comparisons, then as many for the async ones")
        + f", each running its share in blocks of {args.block} consecutive "
        f"pairs, the comparisons taking turns in random order ({elapsed:.0f} s in all). "
        "Every client talks to "
        f"an in-process `{http.__name__}.MockTransport` (the HTTP library of the installed "
        "openai), so no network "
        "or server time is included: what remains is client-side work, end to end through "
        "the SDK. A pair is one request of the plain client and one of the client under test, "
        "in random order; the table gives the mean of the per-pair differences ± its standard "
        "error, and their median, in CPU µs of the process (all its threads). Clients are "
        "warmed up first; the garbage collector's full collections run between blocks, never "
        "inside a timed request (see the module docstring). "
        f"Python {platform.python_version()}, openai {openai.__version__}, "
        f"{platform.machine()}.",
        "",
        "| comparison | plain µs / request (median) | added µs / request: mean ± s.e. | median "
        "| added / plain | process means |",
        "|---|---:|---:|---:|---:|---:|",
        *(comparison.row() for comparison in pooled.values()),
        "",
        "kvturn's own per-request work in a hot loop (its HTTP client hooks on one request "
        "and its answer: turn start, headers, answer headers, the body watched, turn end with "
        "beat planning; less the same loop without them; 20,000 iterations): "
        + (
            "not measured (another version's internals)."
            if math.isnan(hooks)
            else f"**{hooks:.1f} µs**."
        ),
        "",
        f"Turns recorded in the conversations: {', '.join(map(str, turns))} (warm-up included).",
        "",
    ]
    report = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():
        # Keep the hand-written reading of the numbers that follows the generated part.
        previous = args.out.read_text()
        marker = "\n## Reading it\n"
        if marker in previous:
            report += marker + previous.split(marker, 1)[1]
    args.out.write_text(report)
    print(report)


def _unused() -> float:
    raise AssertionError("pooled comparisons are not run")


if __name__ == "__main__":
    main()
