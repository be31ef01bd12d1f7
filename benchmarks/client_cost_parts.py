"""What the parts of a kvturn turn cost inside a streamed request, one at a time.

``client_overhead.py`` times the whole client; this times subclasses of ``openai.OpenAI``
that each add one kind of work kvturn does per streamed turn (or a control: plain
bytecodes, plain allocations), with the same method (pairs against a plain client, blocks
taking turns, fresh processes; see ``client_overhead.py``), next to the kvturn client itself.
It answers whether kvturn's in-request cost comes from a few expensive operations or from
many ordinary ones, each costing far more amid the SDK's cold work than in a hot loop.

    .venv/bin/python benchmarks/client_cost_parts.py [--pairs 800] [--processes 6]

Results go to ``benchmarks/results/client_cost_parts.md``.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import statistics
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import openai

import kvturn.client

sys.path.insert(0, str(Path(__file__).parent))
import client_overhead as bench


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


class Pass(openai.OpenAI):
    """Control: a pass-through ``request()`` override."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        return super().request(*args, **kwargs)


class Bytecodes(openai.OpenAI):
    """Control: ~490 bytecodes of arithmetic on hot local data (kvturn runs ~510 per turn)."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _work(70)
        return super().request(*args, **kwargs)


class Allocations(openai.OpenAI):
    """Control: 25 small objects made and dropped."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        junk = [object() for _ in range(25)]  # noqa: F841
        return super().request(*args, **kwargs)


_lock = threading.Lock()


class Locks(openai.OpenAI):
    """Two lock acquire/release pairs and two clock reads (turn start and end)."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _lock.acquire()
        _lock.release()
        time.monotonic()
        _lock.acquire()
        _lock.release()
        time.monotonic()
        return super().request(*args, **kwargs)


_var: contextvars.ContextVar[Any] = contextvars.ContextVar("part", default=None)


class ContextVariable(openai.OpenAI):
    """A context variable set and reset around the request, read in the per-attempt hook."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        token = _var.set(self)
        try:
            return super().request(*args, **kwargs)
        finally:
            _var.reset(token)

    def _send_request(self, *args: Any, **kwargs: Any) -> Any:
        _var.get()
        return super()._send_request(*args, **kwargs)


class _Holder:
    def gone(self, ref: Any) -> None:
        pass


class WeakReference(openai.OpenAI):
    """A weak reference with a callback to the stream's HTTP response."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        result = super().request(*args, **kwargs)
        holder = _Holder()
        holder.ref = weakref.ref(result.response, holder.gone)  # type: ignore[attr-defined]
        return result


class CloseHook(openai.OpenAI):
    """The response's ``close`` replaced by a hook that removes itself on its first call."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        result = super().request(*args, **kwargs)
        response = result.response

        def close() -> None:
            del response.close
            type(response).close(response)

        response.close = close
        return result


class RawHeaders(openai.OpenAI):
    """The four turn headers appended to each attempt's request as raw items."""

    items = [
        (b"X-Conversation-Id", b"x-conversation-id", b"bench"),
        (b"X-Kvturn-Turn-Id", b"x-kvturn-turn-id", b"0" * 32),
        (b"X-Kvturn-Pause-Ms", b"x-kvturn-pause-ms", b"12"),
        (b"X-Kvturn-Pause-Kind", b"x-kvturn-pause-kind", b"tool"),
    ]

    def _send_request(self, request: Any, **kwargs: Any) -> Any:
        headers = request.headers
        if headers._encoding is None:
            headers.encoding  # noqa: B018
        headers._list.extend(self.items)
        return super()._send_request(request, **kwargs)


PARTS = [Pass, Bytecodes, Allocations, Locks, ContextVariable, WeakReference, CloseHook, RawHeaders]


def measure(pairs: int, seed: int) -> dict[str, float]:
    outside = contextvars.Context()
    inside = contextvars.copy_context()
    kv = bench.make(kvturn.client.OpenAI)
    inside.run(kv.conversation("parts").__enter__)
    cases = [(cls.__name__, bench.make(cls), outside) for cls in PARTS]
    cases.append(("kvturn, in a conversation", kv, inside))
    comparisons = [
        bench.Comparison(
            name,
            bench.in_context(context, bench.sync_request(bench.make(openai.OpenAI), stream=True)),
            bench.in_context(context, bench.sync_request(client, stream=True)),
        )
        for name, client, context in cases
    ]
    bench.run(comparisons, pairs, 50, seed)
    return {c.name: statistics.fmean(c.diffs) for c in comparisons}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=800, help="pairs per case and process")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "client_cost_parts.md"
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        json.dump(measure(args.pairs, args.child), sys.stdout)
        return
    means: dict[str, list[float]] = {}
    for seed in range(1, args.processes + 1):
        command = [sys.executable, __file__, "--child", str(seed), "--pairs", str(args.pairs)]
        answer = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        for name, mean in json.loads(answer).items():
            means.setdefault(name, []).append(mean)
        print(f"process {seed} done", file=sys.stderr)
    docs = {cls.__name__: (cls.__doc__ or "").strip().replace("``", "`") for cls in PARTS}
    rows = [
        f"| {name} | {docs.get(name, 'the kvturn client, for scale')} "
        f"| {statistics.fmean(values):+.1f} ± "
        f"{statistics.stdev(values) / len(values) ** 0.5:.1f} "
        f"| {min(values):+.0f} … {max(values):+.0f} |"
        for name, values in means.items()
    ]
    report = "\n".join(
        [
            "# What the parts of a turn cost inside a streamed request",
            "",
            f"`benchmarks/client_cost_parts.py --pairs {args.pairs} --processes "
            f"{args.processes}`: streamed requests (5 chunks, sync) of a subclass of "
            "`openai.OpenAI` adding one part each, against a plain client, in pairs (method of "
            "`client_overhead.py`). Mean over the processes of each process's mean added CPU "
            f"µs, ± the standard error of those means. Python {sys.version.split()[0]}.",
            "",
            "| case | what it adds | added µs / request | process means |",
            "|---|---|---:|---:|",
            *rows,
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
