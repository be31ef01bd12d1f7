"""examples/turn_report.py: what the example agents record and print, without engines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
