"""What kvturn.client adds to each request, counted in instructions (cachegrind), not timed.

Timing ``client_overhead.py`` measures is what users pay, but on a shared VM whose speed drifts
it cannot tell a few microseconds of change apart. This counts instead: each case runs under
``valgrind --tool=cachegrind`` twice, with ``--requests`` and with none (set-up, imports and
warm-up alike), and the difference divided by ``--requests`` is one request's instructions,
first-level cache misses, and an estimate of cycles (instructions + 12 per L1 miss). The count
is exact for a given memory layout, but the layout matters: which attribute look-ups collide
in CPython's type-attribute cache depends on where names and types sit, and moves a client's
count by tens of thousands of instructions. So every case runs in several layouts (objects
allocated and classes made before the imports, ``--layouts``), and the table gives the mean,
the range, and the count with the cache look-up functions left out (``find_name_in_mro``,
``_PyType_Lookup``, dict look-ups: what layout luck changes most).

    .venv/bin/python benchmarks/client_instructions.py [--layouts 3] [--client-dir DIR]

Needs valgrind. Each run takes about a minute (two run at once); results go to
``benchmarks/results/client_instructions.md``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: Per-request cases: (name, client under test, streamed, tool call).
CASES = {
    "plain": ("openai", False, False),
    "kvturn": ("kvturn", False, False),
    "plain-stream": ("openai", True, False),
    "kvturn-stream": ("kvturn", True, False),
    "plain-stream-tool": ("openai", True, True),
    "kvturn-stream-tool": ("kvturn", True, True),
}
LOOKUP_FUNCTIONS = frozenset(
    {
        "find_name_in_mro",
        "_PyType_Lookup",
        "assign_version_tag.isra.0",
        "unicodekeys_lookup_unicode",
        "_Py_dict_lookup",
        "_PyDict_GetItem_KnownHash",
    }
)


def child(case: str, requests: int, layout: int, client_dir: str | None) -> None:
    """Run under valgrind: warm up, then ``requests`` requests of ``case``."""
    import contextvars
    import gc

    pad = [str(i) * 3 for i in range(layout * 777)]  # noqa: F841  (the layout: kept alive)
    made = [type(f"Pad{i}", (), {})() for i in range(layout * 5)]  # noqa: F841
    sys.path.insert(0, str(Path(__file__).parent))
    import client_overhead as bench
    import openai

    if client_dir is not None:
        bench.use_client_from(Path(client_dir))
    which, stream, tools = CASES[case]
    context = contextvars.copy_context()
    if which == "kvturn":
        client = bench.make(bench.kvturn.client.OpenAI)
        context.run(client.conversation("count").__enter__)
    else:
        client = bench.make(openai.OpenAI)
    call = bench.in_context(context, bench.sync_request(client, stream=stream, tools=tools))
    for _ in range(200):
        call()
    gc.collect()
    gc.freeze()
    for _ in range(requests):
        call()


def counted(case: str, requests: int, layout: int, client_dir: str | None) -> Counter:
    """Cachegrind's counts by function for one run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        command = ["valgrind", "--tool=cachegrind", "--cache-sim=yes"]
        command += [f"--cachegrind-out-file={out}", sys.executable, __file__, "--child", case]
        command += ["--requests", str(requests), "--layout", str(layout)]
        if client_dir is not None:
            command += ["--client-dir", client_dir]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        return _read(out)


Counter = dict[tuple[str, str], int]


def _read(path: Path) -> Counter:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    function = "?"
    for line in path.read_text().splitlines():
        if line.startswith("fn="):
            function = line[3:]
        elif line[:1].isdigit():
            # line Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw
            values = [int(v) for v in line.split()[1:]]
            if len(values) == 9:
                counts[function, "Ir"] += values[0]
                counts[function, "L1"] += values[1] + values[4] + values[7]
    return dict(counts)


def per_request(
    case: str, requests: int, layout: int, client_dir: str | None
) -> dict[tuple[str, str], float]:
    with ThreadPoolExecutor(2) as pool:
        idle = pool.submit(counted, case, 0, layout, client_dir)
        busy = pool.submit(counted, case, requests, layout, client_dir)
        before, after = idle.result(), busy.result()
    return {
        key: (after.get(key, 0) - before.get(key, 0)) / requests for key in set(before) | set(after)
    }


def summary(counts: Any) -> tuple[float, float, float]:
    """(instructions, L1 misses, instructions outside the look-up functions)."""
    instructions = sum(v for (_, kind), v in counts.items() if kind == "Ir")
    misses = sum(v for (_, kind), v in counts.items() if kind == "L1")
    lookups = sum(v for (fn, kind), v in counts.items() if kind == "Ir" and fn in LOOKUP_FUNCTIONS)
    return instructions, misses, instructions - lookups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--cases", default="plain-stream,kvturn-stream")
    parser.add_argument("--client-dir", help="count the client package in this directory")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "client_instructions.md"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.requests, args.layout, args.client_dir)
        return

    cases = args.cases.split(",")
    rows = []
    for case in cases:
        plain_case = case.replace("kvturn", "plain")
        if plain_case == case:
            continue
        added: list[tuple[float, float, float]] = []
        for layout in range(args.layouts):
            plain = summary(per_request(plain_case, args.requests, layout, None))
            other = summary(per_request(case, args.requests, layout, args.client_dir))
            added.append((other[0] - plain[0], other[1] - plain[1], other[2] - plain[2]))
            print(f"{case} layout {layout}: {added[-1]}", file=sys.stderr)
        ir = [a[0] for a in added]
        cycles = [a[0] + 12 * a[1] for a in added]
        rest = [a[2] for a in added]
        rows.append(
            f"| {case} vs {plain_case} | {statistics.fmean(ir):+,.0f} "
            f"({min(ir):+,.0f} … {max(ir):+,.0f}) | {statistics.fmean(cycles):+,.0f} "
            f"| {statistics.fmean(rest):+,.0f} |"
        )
    client = "" if args.client_dir is None else f" --client-dir {args.client_dir}"
    report = "\n".join(
        [
            "# kvturn.client per-request instructions (cachegrind)",
            "",
            f"`benchmarks/client_instructions.py --layouts {args.layouts} --requests "
            f"{args.requests} --cases {args.cases}{client}`: per request, what the kvturn client "
            f"adds to the plain openai client, mean over {args.layouts} memory layouts (see the "
            "module docstring). Python "
            f"{sys.version.split()[0]}.",
            "",
            "| case | instructions: mean (range) | est. cycles (+12 per L1 miss) "
            "| instructions outside type/dict look-ups |",
            "|---|---:|---:|---:|",
            *rows,
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
