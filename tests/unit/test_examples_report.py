"""examples/turn_report.py and examples/demo_compare.py: what the example agents record and
print, and how ``make demo`` compares kvturn with vLLM P/D, without engines (made-up timings)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import demo_compare
import turn_report
from demo_compare import KVTURN, PD


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
    assert "100 ms with kvturn vs 800 ms recomputed (kvturn over recomputed: 0.12 faster)" in out
    assert (
        "100 ms with kvturn vs 200 ms as vLLM P/D with prefix caching "
        "(kvturn over vLLM P/D: 0.50 faster)"
    ) in out
    assert "1.00 same" in out.splitlines()[1]  # call 1: 500 ms each way
    turn_report.print_table([turn_report.Row(r.index, r.kvturn, r.recomputed) for r in rows])
    assert "vLLM P/D" not in capsys.readouterr().out.split("\n")[0]  # not replayed: no column


# --- make demo's comparison (examples/demo_compare.py), with made-up timings ---------------


def test_the_recorder_salts_every_call_it_sends() -> None:
    recorder = turn_report.Recorder(cache_salt="run-7")
    http = turn_report.httpx
    sent = http.Request(
        "POST", "http://gw/v1/chat/completions", json={"model": "m", "messages": []},
        headers={"X-Conversation-Id": "c1"},
    )  # fmt: skip
    request, call = recorder._begin(sent)
    body = json.loads(request.content)
    assert body == {"model": "m", "messages": [], "cache_salt": "run-7"} == call.body
    assert request.headers["content-length"] == str(len(request.content))
    assert request.headers["x-conversation-id"] == "c1" and recorder.calls == [call]
    # Without a salt the request goes as it came.
    unsalted = turn_report.Recorder()
    assert unsalted._begin(sent)[0] is sent and "cache_salt" not in unsalted.calls[0].body


def test_ratios_say_slower_when_kvturn_loses() -> None:
    assert turn_report.ratio_text(0.84, 1.0) == "0.84 faster"
    assert turn_report.ratio_text(1.21, 1.0) == "1.21 slower"
    assert turn_report.ratio_text(1.001, 1.0) == "1.00 same"
    assert turn_report.ratio_text(None, 1.0) == turn_report.ratio_text(1.0, 0.0) == "-"


def test_each_mode_goes_first_once() -> None:
    assert demo_compare.schedule(2) == [(KVTURN, PD), (PD, KVTURN)]
    assert demo_compare.schedule(3)[2] == (KVTURN, PD)


def _answered(body: dict[str, Any], ttft_s: float, plan: str | None = None) -> turn_report.Call:
    call = turn_report.Call(body, status=200, plan=plan, ttft_s=ttft_s)
    call.answer = turn_report.Answer(
        f"reply to {body['messages']}", (), 100 * len(body["messages"]), "stop"
    )
    return call


class FakeEngines:
    """Made-up timings: an engine pair whose first ``cold`` requests take 5 s more, kvturn's
    calls after the first take ``kvturn_s``, plain P/D's ``pd_s``, a recomputed call 3 s."""

    def __init__(self, agents: int, kvturn_s: float, pd_s: float, cold: int = 0) -> None:
        self.kvturn_s, self.pd_s, self.cold = kvturn_s, pd_s, cold
        self.lock = threading.Lock()
        self.served = 0
        # The agents of one run must be under way together: a run that started them one after
        # another would never get past this barrier.
        self.together = threading.Barrier(agents, timeout=10)

    def _extra(self) -> float:
        with self.lock:
            self.served += 1
            return 5.0 if self.served <= self.cold else 0.0

    def agent(self, i: int, recorder: turn_report.Recorder) -> str:
        self.together.wait()
        for j in range(3):
            body = {"messages": [f"agent {i}"] * (j + 1), "cache_salt": recorder.cache_salt}
            ttft = (0.5 if j == 0 else self.kvturn_s) + self._extra()
            recorder.calls.append(_answered(body, ttft, "recompute" if j == 0 else "decode-local"))
        return f"outcome {i}"

    def pd(self, body: dict[str, Any], salt: str) -> turn_report.Call:
        first = len(body["messages"]) == 1
        return _answered(
            {**body, "cache_salt": salt}, (0.5 if first else self.pd_s) + self._extra()
        )

    def recompute(self, body: dict[str, Any]) -> turn_report.Call:
        return _answered({**body, "cache_salt": "fresh"}, 3.0)


def test_the_comparison_warms_up_alternates_and_replays_the_same_calls() -> None:
    engines = FakeEngines(agents=3, kvturn_s=0.2, pd_s=0.4, cold=6)
    said: list[str] = []
    comparison = demo_compare.measure(
        engines.agent, engines.pd, engines.recompute, agents=3, rounds=2, say=said.append
    )
    runs = comparison.warmup + comparison.runs
    assert [(r.mode, r.round, r.position) for r in runs] == [
        (KVTURN, 0, 1), (PD, 0, 2), (KVTURN, 1, 1), (PD, 1, 2), (PD, 2, 1), (KVTURN, 2, 2),
    ]  # fmt: skip
    assert len(said) == 7 and "round 2, first: vLLM P/D, 3 agents at once" in said[4]
    # A salt per run, on every call of the run; the agents of one run share it.
    salts = [r.salt for r in runs]
    assert len(set(salts)) == len(salts)
    for run in runs:
        assert len(run.agents) == 3 and all(len(calls) == 3 for calls in run.agents)
        assert {c.body["cache_salt"] for calls in run.agents for c in calls} == {run.salt}
    # vLLM P/D replays the latest kvturn run's calls: its own round's when kvturn went first,
    # round 1's when it went first itself.
    warm_kv, warm_pd, kv1, pd1, pd2, kv2 = runs
    assert warm_pd.sources is warm_kv.agents and pd1.sources is kv1.agents
    assert pd2.sources is kv1.agents and len(kv2.agents) == 3
    assert demo_compare.prompts_matched(comparison) == (18, 18)
    assert demo_compare.replies_matched(pd2) == (9, 9)
    # The cold requests all fell in the warm-up: no measured figure carries them.
    assert engines.served >= 6 and all(
        c.ttft_s < 5 for r in comparison.runs for a in r.agents for c in a
    )  # type: ignore[operator]
    assert [r.figure for r in comparison.runs] == pytest.approx([0.4, 0.8, 0.8, 0.4])
    assert comparison.recomputed is not None and comparison.recomputed.sources is kv1.agents
    assert demo_compare.replies_matched(comparison.recomputed) == (9, 9)
    assert kv1.outcomes == ["outcome 0", "outcome 1", "outcome 2"]


def test_the_table_reports_medians_order_and_a_loss(capsys: pytest.CaptureFixture[str]) -> None:
    # kvturn slower than plain P/D here (0.4 s against 0.3 s a call after the first).
    engines = FakeEngines(agents=2, kvturn_s=0.4, pd_s=0.3)
    comparison = demo_compare.measure(
        engines.agent, engines.pd, engines.recompute, agents=2, rounds=2, say=lambda _: None
    )
    demo_compare.print_comparison(comparison)
    out = capsys.readouterr().out
    lines = out.splitlines()
    flat = " ".join(out.split())  # the prose lines are wrapped
    assert "kvturn over P/D" in lines[0] and "same answer" in lines[0]
    call2 = next(line for line in lines if line.lstrip().startswith("2 "))
    assert "local 4" in call2 and "400 ms" in call2 and "300 ms" in call2
    assert "1.33 slower" in call2 and "3,000 ms" in call2 and call2.endswith("2/2")
    assert "over 4 agent-runs" in flat
    assert "round 1: kvturn, then vLLM P/D" in out and "round 2: vLLM P/D, then kvturn" in out
    median_line = next(line for line in lines if "median of the 2 rounds" in line)
    assert "800 ms" in median_line and "600 ms" in median_line and "1.33 slower" in median_line
    assert "kvturn over recomputed: 0.13 faster" in out
    assert "kvturn was SLOWER than vLLM P/D with prefix caching here" in flat
    assert "warm-up before any timing (discarded)" in flat
    assert "equal the recomputed in 6 of 6" in flat and "in 12 of 12" in flat


def test_the_picture_draws_the_medians(tmp_path: Path) -> None:
    engines = FakeEngines(agents=1, kvturn_s=0.2, pd_s=0.4)
    comparison = demo_compare.measure(
        engines.agent, engines.pd, None, agents=1, rounds=2, warmup=False, say=lambda _: None
    )
    rows = demo_compare.median_rows(comparison)
    assert [r.kvturn.ttft_s for r in rows] == [0.5, 0.2, 0.2]
    assert [r.deployed.ttft_s if r.deployed else None for r in rows] == [0.5, 0.4, 0.4]
    assert rows[1].kvturn.plan == "decode-local" and rows[1].context_tokens == 200
    assert all(r.recomputed is None for r in rows)
    path = turn_report.plot(rows, tmp_path / "ttft.png", "made-up timings")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_salted_call_reaches_the_server_whole() -> None:
    """Through the openai SDK on the recorder's transport: the server gets the body with the
    salt (a Content-Length that fits it) and the call is recorded with its reply."""
    import http.server

    import openai

    received: list[dict[str, Any]] = []

    class Server(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
            body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recorder = turn_report.Recorder(cache_salt="run-3")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="-",
            http_client=openai.DefaultHttpxClient(transport=recorder.transport()),
        )  # fmt: skip
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "hi"
        client.close()
    finally:
        server.shutdown()
    assert received[0]["cache_salt"] == "run-3" and received[0]["messages"][0]["content"] == "hello"
    (call,) = recorder.calls
    assert call.body == received[0] and call.answer is not None and call.answer.text == "hi"
    assert call.ttft_s is not None and call.status == 200
