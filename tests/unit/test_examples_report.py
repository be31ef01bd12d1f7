"""examples/turn_report.py: what the example agents record and print, without engines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import turn_report


def test_turn_report_parses_streams_and_bodies() -> None:
    stream = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1",'
        b'"function":{"name":"top_rows","arguments":"{\\"table\\""}}]}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'"function":{"arguments":": \\"moons\\"}"}}]},"finish_reason":"tool_calls"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":42,"completion_tokens":7}}\n\n'
        b"data: [DONE]\n\n"
    )
    answer = turn_report.parse_answer(stream)
    assert answer == turn_report.Answer("", (("top_rows", '{"table": "moons"}'),), 42, "tool_calls")
    body: dict[str, Any] = {
        "choices": [{"message": {"content": "Jupiter."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9},
    }
    assert turn_report.parse_answer(json.dumps(body).encode()) == turn_report.Answer(
        "Jupiter.", (), 9, "stop"
    )
    assert turn_report.compact_json('{ \n "a" :\t1 }') == '{"a":1}'


def test_the_table_names_both_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    def call(ttft_s: float, plan: str | None = None) -> turn_report.Call:
        made = turn_report.Call({"messages": []}, plan=plan, ttft_s=ttft_s)
        made.answer = turn_report.Answer("ok", (), 100, "stop")
        return made

    rows = [
        turn_report.Row(1, call(0.5, "recompute"), call(0.5), call(0.5)),
        turn_report.Row(2, call(0.1, "decode-local"), call(0.8), call(0.2)),
    ]
    turn_report.print_table(rows)
    out = capsys.readouterr().out
    assert "TTFT recompute" in out and "TTFT vLLM P/D" in out
    assert "100 ms with kvturn vs 800 ms recomputed (x8.00)" in out
    assert "100 ms with kvturn vs 200 ms as vLLM P/D with prefix caching (x2.00)" in out
    turn_report.print_table([turn_report.Row(r.index, r.kvturn, r.recomputed) for r in rows])
    assert "vLLM P/D" not in capsys.readouterr().out.split("\n")[0]  # not replayed: no column
