"""A replayed stream (:mod:`kvturn.gateway.turns.replay`): a chat reply a continuation cannot
carry (tools, a grammar), replayed from scratch and relayed from where the client's stream
stopped: no text or tool-call arguments twice, a tool call keeps the id it was announced
with, and a replay that diverges from what was sent ends the stream rather than contradict
it. (On real engines, a decode killed mid-stream: ``tests/test_fault_matrix.py``.)"""

from __future__ import annotations

from typing import Any

import orjson

from kvturn.gateway.turns.migrate import migratable
from kvturn.gateway.turns.model import Turn
from kvturn.gateway.turns.replay import Replay, ReplaySeam, Sent, replayable

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "record", "parameters": {}}}]


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(stream_id: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    return event({"id": stream_id, "object": "chat.completion.chunk", "created": 1,
                  "model": "m", "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": finish}]})  # fmt: skip


def call(index: int, arguments: str = "", **announced: str) -> dict[str, Any]:
    """A tool-call delta: ``announced`` its id and name (the first of its index)."""
    function: dict[str, Any] = {"arguments": arguments} if arguments else {}
    if "name" in announced:
        function["name"] = announced["name"]
    delta: dict[str, Any] = {"index": index, "function": function}
    if "id" in announced:
        delta.update(id=announced["id"], type="function")
    return {"tool_calls": [delta]}


def payloads(data: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


#: A reply of text, then one tool call, as vLLM streams it (role first).
def reply(stream_id: str, call_id: str) -> list[bytes]:
    return [
        chunk(stream_id, {"role": "assistant", "content": ""}),
        chunk(stream_id, {"content": "Let me "}),
        chunk(stream_id, {"content": "look."}),
        chunk(stream_id, call(0, id=call_id, name="record")),
        chunk(stream_id, call(0, '{"path": ')),
        chunk(stream_id, call(0, '"a.py", "line": 3}')),
        chunk(stream_id, {}, finish="tool_calls"),
        b"data: [DONE]\n\n",
    ]


def test_only_a_reproducible_single_chat_reply_is_replayed() -> None:
    greedy = {"stream": True, "messages": [], "tools": TOOLS, "temperature": 0}
    assert replayable(CHAT, greedy) and not migratable(CHAT, greedy)
    assert replayable(CHAT, {**greedy, "temperature": 0.8, "seed": 3})
    assert replayable(CHAT, {**greedy, "response_format": {"type": "json_object"}})
    assert not replayable(CHAT, {**greedy, "temperature": 0.8})  # another draw, another reply
    assert not replayable(CHAT, {k: v for k, v in greedy.items() if k != "temperature"})
    assert not replayable(CHAT, {**greedy, "n": 2})
    assert not replayable(CHAT, {**greedy, "logprobs": True})
    assert not replayable(CHAT, {**greedy, "return_token_ids": True})
    assert not replayable(CHAT, {**greedy, "stream": False})  # whole replies retry from scratch
    assert not replayable("/v1/completions", {**greedy, "prompt": "x"})


def test_a_replay_goes_on_from_where_the_client_stopped_under_the_ids_it_knows() -> None:
    sent = Sent()
    original = reply("chatcmpl-first", "call-first")
    relayed, broke = sent.feed(b"".join(original[:5]))  # up to the call's first arguments
    assert not broke and relayed == b"".join(original[:5])  # relayed as it came
    assert sent.text == {"content": "Let me look."}
    assert sent.tools[0].arguments == '{"path": '

    seam = ReplaySeam(sent)
    # The replay's events arrive in other pieces than the original's.
    replayed = b"".join(reply("chatcmpl-replay", "call-replay"))
    out, broke = seam.feed(replayed[:100])
    more, broke_later = seam.feed(replayed[100:])
    assert not broke and not broke_later
    events = payloads(out + more)
    assert all(e["id"] == "chatcmpl-first" for e in events)
    deltas = [e["choices"][0]["delta"] for e in events]
    # No role, no text, no id or name again: only the arguments past what was sent.
    rest = {"index": 0, "function": {"arguments": '"a.py", "line": 3}'}}
    assert deltas == [{"tool_calls": [rest]}, {}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert (out + more).endswith(b"data: [DONE]\n\n")
    assert sent.tools[0].arguments == '{"path": "a.py", "line": 3}'
    assert sent.tools[0].id == "call-first"


def test_a_tool_call_announced_after_the_seam_keeps_the_replays_id() -> None:
    sent = Sent()
    original = reply("chatcmpl-first", "call-first")
    sent.feed(b"".join(original[:2]))  # "Let me " only
    seam = ReplaySeam(sent)
    out, broke = seam.feed(b"".join(reply("chatcmpl-replay", "call-replay")))
    assert not broke
    deltas = [e["choices"][0]["delta"] for e in payloads(out)]
    assert deltas[0] == {"content": "look."}
    assert deltas[1]["tool_calls"][0]["id"] == "call-replay"
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "record"}


def test_a_replay_that_diverges_is_not_relayed_and_the_stream_cannot_move_again() -> None:
    sent = Sent()
    sent.feed(b"".join(reply("chatcmpl-first", "call-first")[:5]))
    turn = Turn(CHAT, {"stream": True, "temperature": 0, "tools": TOOLS, "messages": []}, None)
    replay = Replay(turn, sent, ReplaySeam(sent), limit=3, resume=None)  # type: ignore[arg-type]
    again = replay.continuation()
    assert again is not None and again.resumes and again.body == turn.body
    other = [chunk("r", {"role": "assistant"}), chunk("r", {"content": "Let me think."})]
    out, broke = replay.seam.feed(b"".join(other))
    assert broke and out == b""
    assert replay.seam.diverged is not None and "content" in replay.seam.diverged
    assert replay.continuation() is None


def test_a_replay_that_ends_short_of_what_was_sent_diverges() -> None:
    sent = Sent()
    sent.feed(b"".join(reply("chatcmpl-first", "call-first")[:3]))
    seam = ReplaySeam(sent)
    _, broke = seam.feed(chunk("r", {"content": "Let me "}) + chunk("r", {}, finish="stop"))
    assert broke and seam.diverged is not None


def test_a_new_replay_starts_from_the_beginning_again() -> None:
    sent = Sent()
    sent.feed(b"".join(reply("chatcmpl-first", "call-first")[:3]))
    turn = Turn(CHAT, {"stream": True, "temperature": 0, "tools": TOOLS, "messages": []}, None)
    replay = Replay(turn, sent, ReplaySeam(sent), limit=2, resume=None)  # type: ignore[arg-type]
    assert replay.continuation() is not None
    replay.seam.feed(chunk("r", {"content": "Let me "}))  # and that replay broke off too
    assert replay.continuation() is not None
    out, broke = replay.seam.feed(b"".join(reply("r2", "c2")[:3]))
    assert not broke and out == b""  # all of it sent before
    assert replay.continuation() is None  # the bound
