"""benchmarks/aiperf_multiturn.py, from AIPerf's own records of a run (no engines, no AIPerf): the
least job any deployment could take, and the replies it compares."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import aiperf_multiturn

S = 1_000_000_000  # nanoseconds


def write_records(out: Path, turns: list[tuple[str, int, float, float]]) -> None:
    """``profile_export.jsonl`` as AIPerf writes it: one record a turn, in no set order."""
    out.mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "metadata": {
                    "conversation_id": conversation,
                    "turn_index": index,
                    "request_start_ns": int(start * S),
                    "request_end_ns": int(end * S),
                },
                "metrics": {},
            }
        )
        for conversation, index, start, end in turns
    ]
    (out / "profile_export.jsonl").write_text("\n".join(reversed(lines)) + "\n")


def test_pauses_are_the_gaps_between_a_conversations_turns(tmp_path: Path) -> None:
    write_records(
        tmp_path / "kvturn-0",
        [
            # a: turns end at 1 and 5, the next start at 4 and 9: paused 3 + 4 s.
            ("a", 0, 0.0, 1.0),
            ("a", 1, 4.0, 5.0),
            ("a", 2, 9.0, 9.5),
            # b: one pause of 2 s, its turns long (what the deployment spent is not a pause).
            ("b", 0, 0.0, 3.0),
            ("b", 1, 5.0, 12.0),
            # c: one turn, no pause.
            ("c", 0, 10.0, 11.0),
        ],
    )
    taken = aiperf_multiturn.pauses_taken(tmp_path)
    assert taken == pytest.approx({"longest_s": 7.0, "total_s": 9.0})


def test_the_floor_is_the_longest_conversations_pauses_or_all_pauses_over_the_slots() -> None:
    workload = {"conversations": 4, "turns": 3, "delay_ms": 1000, "concurrency": 2}
    # One conversation paused far longer than the rest: no deployment ends before it.
    assert aiperf_multiturn.job_floor_s(
        {"pauses": {"longest_s": 30.0, "total_s": 36.0}}, workload
    ) == pytest.approx(30.0)
    # Even pauses: two slots share 40 s of them, 20 s each at the least.
    assert aiperf_multiturn.job_floor_s(
        {"pauses": {"longest_s": 10.0, "total_s": 40.0}}, workload
    ) == pytest.approx(20.0)
    # A run from before pauses were recorded: the busiest slot's at their mean (2 conversations
    # a slot, 2 pauses of 1 s each).
    assert aiperf_multiturn.job_floor_s({}, workload) == pytest.approx(4.0)


def test_a_turn_without_content_is_an_empty_reply_not_a_differing_one(tmp_path: Path) -> None:
    # ``outputs.json`` as AIPerf 0.13 writes it (``--export-outputs-json``).
    outputs = {
        "schema_version": "1",
        "data": [
            {"conversation_id": "a", "turn_index": 0, "response_text": "Jupiter."},
            # A turn whose stream carried no content (AIPerf counts it as an error).
            {"conversation_id": "a", "turn_index": 1, "metrics": {}, "response_text": None},
        ],
    }
    for mode in ("vllm-pd", "kvturn"):
        (tmp_path / f"answers-{mode}").mkdir()
        (tmp_path / f"answers-{mode}" / "outputs.json").write_text(json.dumps(outputs))
    replies = aiperf_multiturn.answers(tmp_path / "answers-kvturn")
    assert replies == {("a", 0): "Jupiter.", ("a", 1): ""}
    checked = aiperf_multiturn.answers_compared(("vllm-pd", "kvturn"), tmp_path)
    assert checked["modes"]["kvturn"] == {"equal": 2, "differ": [], "empty_in_baseline": 1}
