"""The comparison ``make demo`` prints: kvturn against vLLM P/D with prefix caching, fairly.

How it is measured (:func:`measure`):

1. **A warm-up, discarded.** Before anything is timed, the agents run once through kvturn and
   their calls are replayed once as plain P/D: fresh CPU engines serve their first requests
   several times slower, and whichever mode ran first would pay for it (the demo used to run
   kvturn first on engines that had served one request, then the baselines on warm ones).
2. **Rounds in alternating order** (:func:`schedule`): round 1 runs kvturn, then vLLM P/D;
   round 2 vLLM P/D, then kvturn; so each mode runs once first and once second.
3. **Several agents at once.** A kvturn run starts ``agents`` instances of the agent together
   (threads released by one barrier), each a conversation of its own (a new id; the log agent
   also gets an incident of its own). A vLLM P/D run replays the calls of the latest kvturn run
   in the same shape: one stream per agent, all started together, each sending its agent's
   calls in order, the next once the last is answered. Decode's streams are shared as in real
   serving, by both modes alike. (In round 2 vLLM P/D goes first, so it replays round 1's
   kvturn calls; :func:`prompts_matched` counts whether they were the calls kvturn then made.)
4. **A ``cache_salt`` per run.** Every request of a run carries the run's own salt (kvturn's
   through :class:`turn_report.Recorder`, vLLM P/D's in the replay), so no run finds another
   run's prompts in an engine's prefix cache; the agents of one run share it, so their common
   system prompt and tools are cached as in one deployment.
5. **Recomputed, once, last:** the first measured kvturn run's calls again in the same shape,
   each as the first turn of a new conversation with a fresh salt (nothing to reuse): the
   "recompute" column, and the "same answer" check.

The report (:func:`print_comparison`): one row per model call, each TTFT the median over every
agent of every measured run of its mode; then calls 2..N summed per agent (a run's figure is
the median of its agents), for each round with its order, and the median of the rounds. Every
ratio is kvturn's time over the baseline's: above 1.00 kvturn was slower, and the table says so.
"""

from __future__ import annotations

import statistics
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import turn_report
from turn_report import Call, Recorder, Row, ratio_text

KVTURN = "kvturn"
PD = "vLLM P/D"
RECOMPUTE = "recompute"

#: Runs one instance of the agent (its index) through kvturn, every call recorded by the
#: recorder it is given; returns the agent's outcome.
AgentFn = Callable[[int, Recorder], Any]
#: Sends one recorded body as plain P/D under a salt: the replayed call.
PdFn = Callable[[dict[str, Any], str], Call]
#: Sends one recorded body recomputed (a new conversation, a fresh salt).
RecomputeFn = Callable[[dict[str, Any]], Call]

T = TypeVar("T")


def schedule(rounds: int) -> list[tuple[str, str]]:
    """Each measured round's order: kvturn first in rounds 1, 3, ..., vLLM P/D in 2, 4, ..."""
    return [(KVTURN, PD) if r % 2 == 0 else (PD, KVTURN) for r in range(rounds)]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def together(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """``jobs`` in threads released at the same moment; their results, in order. The first
    failure is raised once every job has ended."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)

    def work(i: int) -> None:
        try:
            barrier.wait()
            results[i] = jobs[i]()
        except BaseException as error:  # re-raised below, in the caller's thread
            errors[i] = error

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


@dataclass
class Run:
    """One mode's run: every agent's calls, in order."""

    mode: str
    #: 0 for the warm-up, then 1, 2, ...
    round: int
    #: 1 when the mode went first in its round, 2 when second.
    position: int
    #: The run's ``cache_salt`` (empty for the recompute run: a fresh one per call).
    salt: str
    agents: list[list[Call]]
    #: For a replay: the kvturn calls it replayed (``agents[i][j]`` replays ``sources[i][j]``).
    sources: list[list[Call]] | None = None
    wall_s: float = 0.0
    #: The agents' outcomes (kvturn runs only).
    outcomes: list[Any] = field(default_factory=list)

    def totals(self, first: int = 2) -> list[float]:
        """TTFT of calls ``first``.. summed, per agent (an agent with a call that has no TTFT
        is left out)."""
        sums = []
        for calls in self.agents:
            times = [c.ttft_s for c in calls[first - 1 :]]
            if times and all(t is not None for t in times):
                sums.append(sum(t for t in times if t is not None))
        return sums

    @property
    def figure(self) -> float | None:
        """The run's calls 2..N: the median over its agents of each one's summed TTFT."""
        return median(self.totals())


@dataclass
class Comparison:
    agents: int
    #: The warm-up's runs (discarded: not in any figure).
    warmup: list[Run]
    #: The measured runs, in the order they ran.
    runs: list[Run]
    recomputed: Run | None = None

    def of(self, mode: str) -> list[Run]:
        return [run for run in self.runs if run.mode == mode]

    @property
    def rounds(self) -> int:
        return max((run.round for run in self.runs), default=0)

    @property
    def first_kvturn(self) -> Run:
        return self.of(KVTURN)[0]


def measure(
    run_agent: AgentFn,
    replay_pd: PdFn,
    recompute: RecomputeFn | None,
    agents: int = 3,
    rounds: int = 2,
    warmup: bool = True,
    say: Callable[[str], None] = print,
) -> Comparison:
    """The warm-up (if ``warmup``), ``rounds`` rounds in :func:`schedule`'s order, and, given
    ``recompute``, the first measured kvturn run's calls recomputed; see the module's doc."""
    latest: list[Run] = []

    def go(mode: str, round_: int, position: int) -> Run:
        salt = f"demo-{'kvturn' if mode == KVTURN else 'pd'}-{round_}-{uuid.uuid4().hex[:12]}"
        started = time.perf_counter()
        if mode == KVTURN:
            recorders = [Recorder(cache_salt=salt) for _ in range(agents)]
            outcomes = together([partial(run_agent, i, recorders[i]) for i in range(agents)])
            run = Run(mode, round_, position, salt, [r.calls for r in recorders])
            run.outcomes = outcomes
            latest[:] = [run]
        else:
            if not latest:
                raise RuntimeError("vLLM P/D replays kvturn's calls: run kvturn first")
            sources = latest[0].agents

            def replay_agent(calls: list[Call]) -> list[Call]:
                return [replay_pd(call.body, salt) for call in calls]

            replayed = together([partial(replay_agent, calls) for calls in sources])
            run = Run(mode, round_, position, salt, replayed, sources=sources)
        run.wall_s = time.perf_counter() - started
        where = "warm-up" if round_ == 0 else f"round {round_}"
        say(
            f"  {where}, {'first' if position == 1 else 'second'}: {mode}, "
            f"{agents} agent{'s' if agents > 1 else ''} at once: {run.wall_s:.1f} s"
        )
        return run

    warm = [go(KVTURN, 0, 1), go(PD, 0, 2)] if warmup else []
    runs = [
        go(mode, r, position)
        for r, order in enumerate(schedule(rounds), 1)
        for position, mode in enumerate(order, 1)
    ]
    comparison = Comparison(agents, warm, runs)
    if recompute is not None:
        sources = comparison.first_kvturn.agents
        started = time.perf_counter()

        def recompute_agent(calls: list[Call]) -> list[Call]:
            return [recompute(call.body) for call in calls]

        again = together([partial(recompute_agent, calls) for calls in sources])
        comparison.recomputed = Run(RECOMPUTE, 0, 0, "", again, sources=sources)
        comparison.recomputed.wall_s = time.perf_counter() - started
        say(f"  recomputed, last: round 1's kvturn calls: {comparison.recomputed.wall_s:.1f} s")
    return comparison


def same_reply(a: Call, b: Call) -> bool:
    """Both answered, with the same text and tool calls (usage may differ)."""
    return (
        a.answer is not None
        and b.answer is not None
        and (a.answer.text, a.answer.tool_calls) == (b.answer.text, b.answer.tool_calls)
    )


def _without_salt(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "cache_salt"}


def _pairs(a: list[list[Call]], b: list[list[Call]]) -> list[tuple[Call, Call]]:
    return [(x, y) for xs, ys in zip(a, b, strict=False) for x, y in zip(xs, ys, strict=False)]


def replies_matched(run: Run) -> tuple[int, int]:
    """(replies equal to the kvturn reply they replayed, replies compared)."""
    pairs = _pairs(run.agents, run.sources or [])
    return sum(same_reply(x, y) for x, y in pairs), len(pairs)


def prompts_matched(comparison: Comparison) -> tuple[int, int]:
    """(calls whose body a vLLM P/D run replayed is the body kvturn sent in that round, salt
    aside; calls compared): the P/D runs that went first replayed an earlier round's calls."""
    equal = total = 0
    for pd in comparison.of(PD):
        kv = [r for r in comparison.of(KVTURN) if r.round == pd.round]
        if not kv or pd.sources is None:
            continue
        for x, y in _pairs(pd.sources, kv[0].agents):
            equal += _without_salt(x.body) == _without_salt(y.body)
            total += 1
    return equal, total


@dataclass
class CallStats:
    """One model call (its place in the agent's run), over every agent of every run."""

    index: int
    step: str
    context: float | None
    plans: Counter[str]
    reused: float | None
    kvturn: float | None
    pd: float | None
    recompute: float | None
    #: (kvturn replies equal to the same call recomputed, calls compared).
    same: tuple[int, int]


def _nth(runs: Sequence[Run], j: int) -> list[Call]:
    return [calls[j] for run in runs for calls in run.agents if len(calls) > j]


def _ttft(calls: Sequence[Call]) -> float | None:
    return median([c.ttft_s for c in calls if c.ttft_s is not None])


def call_stats(comparison: Comparison) -> list[CallStats]:
    kv_runs, pd_runs = comparison.of(KVTURN), comparison.of(PD)
    recomputed = [comparison.recomputed] if comparison.recomputed else []
    count = max((len(calls) for run in kv_runs for calls in run.agents), default=0)
    stats = []
    for j in range(count):
        kv = _nth(kv_runs, j)
        rc = _nth(recomputed, j)
        sources = [c[j] for c in (recomputed[0].sources or []) if len(c) > j] if rc else []
        pairs = list(zip(rc, sources, strict=False))
        contexts = [
            float(c.answer.prompt_tokens) for c in kv + rc if c.answer and c.answer.prompt_tokens
        ]
        first = comparison.first_kvturn.agents[0]
        stats.append(
            CallStats(
                index=j + 1,
                step=turn_report.step_label(first[j]) if len(first) > j else "",
                context=median(contexts),
                plans=Counter(c.plan or "?" for c in kv),
                reused=median([float(c.reused_tokens) for c in kv]),
                kvturn=_ttft(kv),
                pd=_ttft(_nth(pd_runs, j)),
                recompute=_ttft(rc),
                same=(sum(same_reply(x, y) for x, y in pairs), len(pairs)),
            )
        )
    return stats


_SHORT = {"decode-local": "local", "pull-reuse": "pull"}


def _plans(plans: Counter[str]) -> str:
    return ", ".join(f"{_SHORT.get(p, p)} {n}" for p, n in plans.most_common())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def round_figures(
    comparison: Comparison,
) -> list[tuple[int, list[str], float | None, float | None]]:
    """Per measured round: its number, its order, kvturn's figure and vLLM P/D's."""
    out = []
    for r in range(1, comparison.rounds + 1):
        runs = sorted((x for x in comparison.runs if x.round == r), key=lambda x: x.position)
        figures = {x.mode: x.figure for x in runs}
        out.append((r, [x.mode for x in runs], figures.get(KVTURN), figures.get(PD)))
    return out


def _say(text: str) -> None:
    print(textwrap.fill(text, width=100))


def print_comparison(comparison: Comparison) -> None:
    """The per-call table, then calls 2..N per round and their medians; see the module."""
    stats = call_stats(comparison)
    kv_runs = len(comparison.of(KVTURN)) * comparison.agents
    print(
        f"{'call':>4}  {'step':<20} {'context':>7}  {'plans':<20} {'reused':>6} "
        f"{'TTFT kvturn':>11} {'TTFT vLLM P/D':>13} {'kvturn over P/D':>15} "
        f"{'TTFT recompute':>14}  same answer"
    )
    for s in stats:
        context = "-" if s.context is None else f"{s.context:.0f}"
        reused = "-" if s.reused is None else f"{s.reused:.0f}"
        same = f"{s.same[0]}/{s.same[1]}" if s.same[1] else "-"
        print(
            f"{s.index:>4}  {s.step[:20]:<20} {context:>7}  {_plans(s.plans):<20} {reused:>6} "
            f"{_ms(s.kvturn):>11} {_ms(s.pd):>13} {ratio_text(s.kvturn, s.pd):>15} "
            f"{_ms(s.recompute):>14}  {same}"
        )
    _say(
        f"(each TTFT: the median over {kv_runs} agent-runs of its mode, "
        f"{comparison.agents} agents at once in each run; plans: how many of kvturn's "
        "agent-runs had each, local = decode-local, pull = pull-reuse; context and reused: "
        "medians, in tokens)"
    )
    if not stats:
        return
    n = len(stats)
    print(
        f"\ncalls 2..{n}, TTFT summed per agent (each run: the median of its "
        f"{comparison.agents} agents):"
    )
    print(f"  {'':<34} {'kvturn':>10} {'vLLM P/D':>10}  kvturn over vLLM P/D")
    figures = round_figures(comparison)
    for r, order, kv, pd in figures:
        label = f"round {r}: " + ", then ".join(order)
        print(f"  {label:<34} {_ms(kv):>10} {_ms(pd):>10}  {ratio_text(kv, pd)}")
    kv_median = median([kv for _, _, kv, _ in figures if kv is not None])
    pd_median = median([pd for _, _, _, pd in figures if pd is not None])
    print(
        f"  {f'median of the {len(figures)} rounds':<34} {_ms(kv_median):>10} "
        f"{_ms(pd_median):>10}  {ratio_text(kv_median, pd_median)}"
    )
    recomputed = comparison.recomputed
    rc_figure = recomputed.figure if recomputed else None
    if rc_figure is not None:
        print(
            f"  {'recomputed (once, last)':<34} {'':>10} {_ms(rc_figure):>10}  "
            f"kvturn over recomputed: {ratio_text(kv_median, rc_figure)}"
        )
    if kv_median and pd_median:
        verdict = ratio_text(kv_median, pd_median)
        if kv_median > pd_median and verdict != "1.00 same":
            print(
                f"\nkvturn was SLOWER than vLLM P/D with prefix caching here: its calls 2..{n} "
                f"took {kv_median / pd_median:.2f}x as long (median of the rounds)."
            )
        else:
            print(
                f"\nkvturn over vLLM P/D with prefix caching, calls 2..{n}: {verdict} "
                "(median of the rounds)."
            )
    if comparison.warmup:
        spent = ", ".join(f"{run.mode} {run.wall_s:.1f} s" for run in comparison.warmup)
        print(f"warm-up before any timing (discarded): {spent}")
    lines = []
    if recomputed is not None:
        equal, total = replies_matched(recomputed)
        lines.append(f"kvturn's equal the recomputed in {equal} of {total} calls")
    pd_equal = [replies_matched(run) for run in comparison.of(PD)]
    if pd_equal:
        equal, total = sum(e for e, _ in pd_equal), sum(t for _, t in pd_equal)
        lines.append(f"vLLM P/D's equal the kvturn replies they replayed in {equal} of {total}")
    equal, total = prompts_matched(comparison)
    if total:
        lines.append(
            f"vLLM P/D replayed the prompts kvturn sent in its round in {equal} of {total}"
        )
    if lines:
        _say("answers: " + "; ".join(lines) + ".")
    _say(
        "Both modes on warm engines, each run its own conversations and cache_salt (no run "
        "finds another's prompts in a prefix cache). vLLM P/D: the same calls as plain P/D "
        "straight to the engines (prefill, then decode), prefill's prefix cache on (vLLM's "
        "default), one stream per agent, all at once. recompute: each call alone in a new "
        "conversation, a fresh cache_salt. A ratio above 1.00 means kvturn took longer."
    )


def median_rows(comparison: Comparison) -> list[Row]:
    """The per-call medians as :class:`turn_report.Row` s, for :func:`turn_report.plot`
    (the plan shown is the one most of kvturn's agent-runs had)."""
    rows = []
    for s in call_stats(comparison):
        plan = s.plans.most_common(1)[0][0] if s.plans else None
        kv = Call({}, status=200, plan=plan, reused_tokens=int(s.reused or 0), ttft_s=s.kvturn)
        context = int(s.context) if s.context is not None else None
        kv.answer = turn_report.Answer("", (), context, None)
        rc = Call({}, ttft_s=s.recompute) if s.recompute is not None else None
        pd = Call({}, ttft_s=s.pd) if s.pd is not None else None
        rows.append(Row(s.index, kv, rc, pd))
    return rows


def pd_sender(engines: tuple[str, str], api_key: str = "unused") -> PdFn:
    """:func:`turn_report.replay_deployed` on a client of the calling thread's own."""
    local = threading.local()

    def send(body: dict[str, Any], salt: str) -> Call:
        if not hasattr(local, "http"):
            local.http = turn_report.httpx.Client(timeout=600)
        return turn_report.replay_deployed(local.http, engines, body, salt, api_key)

    return send


def recompute_sender(base_url: str, api_key: str = "unused") -> RecomputeFn:
    """:func:`turn_report.replay_one` on a client of the calling thread's own."""
    local = threading.local()

    def send(body: dict[str, Any]) -> Call:
        if not hasattr(local, "http"):
            local.http = turn_report.httpx.Client(timeout=600)
        return turn_report.replay_one(local.http, base_url, body, api_key)

    return send
