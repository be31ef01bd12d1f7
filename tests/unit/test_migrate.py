"""A broken stream's ledger and seam (:mod:`kvturn.gateway.turns.migrate`): what was sent is
known by token ids, the continuation asks for exactly the rest, and its chunks reach the client
in the original stream's shape. (The whole path on real engines, a decode killed mid-stream,
is ``tests/test_fault_matrix.py``.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from kvturn.gateway.pools import Instance
from kvturn.gateway.turns.migrate import (
    Ledger,
    Migration,
    Seam,
    continuation_body,
    migratable,
)
from kvturn.gateway.turns.model import Turn
from kvturn.gateway.turns.relay import HangWatch

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chat_chunk(content: str | None, ids: list[int], **extra: Any) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    choice = {"index": 0, "delta": delta, "finish_reason": extra.pop("finish", None)}
    choice["token_ids"] = ids
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [choice], **extra}  # fmt: skip


def payloads(data: bytes) -> list[Any]:
    return [
        orjson.loads(e[6:]) if e[6:] != b"[DONE]" else "[DONE]"
        for e in data.split(b"\n\n")
        if e.startswith(b"data: ")
    ]


def test_what_cannot_be_continued_faithfully_is_not_migratable() -> None:
    chat = {"stream": True, "messages": []}
    assert migratable(CHAT, chat)
    assert migratable(COMPLETIONS, {"stream": True, "prompt": "hi"})
    assert migratable(COMPLETIONS, {"stream": True, "prompt": [1, 2]})
    assert not migratable(CHAT, {**chat, "stream": False})  # whole replies retry from scratch
    assert not migratable(CHAT, {**chat, "n": 2})
    assert not migratable(CHAT, {**chat, "logprobs": True})
    assert not migratable(CHAT, {**chat, "frequency_penalty": 0.5})
    assert not migratable(CHAT, {**chat, "response_format": {"type": "json_object"}})
    assert not migratable(CHAT, {**chat, "tools": [{"type": "function"}]})
    assert migratable(CHAT, {**chat, "tools": [{"type": "function"}], "tool_choice": "none"})
    assert not migratable(COMPLETIONS, {"stream": True, "prompt": ["a", "b"]})  # a batch
    assert not migratable("/v1/responses", {"stream": True})


def test_the_ledger_records_ids_and_text_and_strips_what_the_client_did_not_ask() -> None:
    ledger = Ledger(chat=True, client_ids=False)
    first = chat_chunk("", [], prompt_token_ids=[1, 2, 3])
    first["choices"][0]["delta"]["role"] = "assistant"
    stream = event(first) + event(chat_chunk("He", [10])) + event(chat_chunk(None, [11]))
    stream += event(chat_chunk("llo", [12]))
    # Split mid-event: only whole events go out, and nothing is counted twice.
    out1, broke1 = ledger.feed(stream[:40])
    out2, broke2 = ledger.feed(stream[40:])
    assert not broke1 and not broke2
    sent = payloads(out1 + out2)
    assert [p["choices"][0]["delta"].get("content") for p in sent] == ["", "He", "llo"]
    # The fields vLLM sends a client that did not ask for ids, null.
    assert sent[0]["prompt_token_ids"] is None
    assert all(p["choices"][0]["token_ids"] is None for p in sent)
    assert (ledger.prompt_ids, ledger.reply_ids, "".join(ledger.text)) == (
        [1, 2, 3],
        [10, 11, 12],
        "Hello",
    )
    assert ledger.resumable
    # A failure's error event: what came before it goes out, the failure is reported.
    error = event({"error": {"message": "engine died", "code": 500}})
    out, broke = ledger.feed(event(chat_chunk("!", [13])) + error + event(chat_chunk("x", [14])))
    assert broke and [p["choices"][0]["delta"]["content"] for p in payloads(out)] == ["!"]
    assert ledger.reply_ids == [10, 11, 12, 13]


def test_an_error_about_the_request_itself_is_relayed_not_a_failure() -> None:
    ledger = Ledger(chat=False, client_ids=True)
    out, broke = ledger.feed(event({"error": {"message": "bad", "code": 400}}))
    assert not broke and b"bad" in out


def test_a_completion_stream_carries_its_prompt_ids_in_its_choice() -> None:
    ledger = Ledger(chat=False, client_ids=False)
    choice = {"index": 0, "text": "a", "prompt_token_ids": [1, 2], "token_ids": [9]}
    out, _ = ledger.feed(event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]}))
    assert (ledger.prompt_ids, ledger.reply_ids) == ([1, 2], [9])
    (sent,) = payloads(out)
    assert sent["choices"][0] == {
        "index": 0,
        "text": "a",
        "prompt_token_ids": None,
        "token_ids": None,
    }
    # An empty completion chunk goes out all the same: vLLM sends those without ids too.
    empty = {"index": 0, "text": "", "prompt_token_ids": None, "token_ids": [10]}
    out, _ = ledger.feed(event({"id": "cmpl-1", "object": "text_completion", "choices": [empty]}))
    assert payloads(out)[0]["choices"][0]["text"] == ""


def test_a_client_that_asked_for_ids_gets_the_chunks_as_they_came() -> None:
    ledger = Ledger(chat=True, client_ids=True)
    raw = event(chat_chunk("a", [5], prompt_token_ids=[1]))
    assert ledger.feed(raw) == (raw, False)


def test_the_continuation_asks_for_exactly_the_rest() -> None:
    ledger = Ledger(chat=True, client_ids=False, prompt_ids=[1, 2], reply_ids=[7, 8, 9])
    body = {"model": "m", "messages": [], "max_tokens": 10, "temperature": 0, "seed": 5,
            "stop": ["\n"], "min_tokens": 2, "stream": True, "presence_penalty": 0}  # fmt: skip
    cont = continuation_body(body, ledger)
    assert cont is not None
    assert cont["prompt"] == [1, 2, 7, 8, 9]
    assert (cont["max_tokens"], cont["min_tokens"], cont["seed"]) == (7, 0, 8)
    assert (cont["temperature"], cont["stop"], cont["model"]) == (0, ["\n"], "m")
    assert cont["return_token_ids"] and cont["stream"]
    assert "messages" not in cont and "presence_penalty" not in cont
    assert continuation_body({**body, "max_tokens": 3}, ledger) is None  # nothing left
    assert "max_tokens" not in continuation_body({"model": "m"}, ledger)  # type: ignore[operator]


def test_the_seam_reshapes_completion_chunks_as_the_original_chat_stream() -> None:
    ledger = Ledger(chat=True, client_ids=False, prompt_ids=[1, 2], reply_ids=[7])
    ledger.shape = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
    }
    seam = Seam(ledger, usage=True)
    cont = [
        {"id": "cmpl-9", "object": "text_completion", "choices": [
            {"index": 0, "text": " more", "token_ids": [8, 9], "finish_reason": None}]},
        {"id": "cmpl-9", "object": "text_completion", "choices": [
            {"index": 0, "text": "", "token_ids": [10], "finish_reason": "length"}]},
        {"id": "cmpl-9", "object": "text_completion", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                   "prompt_tokens_details": {"cached_tokens": 2}}},
    ]  # fmt: skip
    data = b"".join(event(p) for p in cont) + b"data: [DONE]\n\n"
    out, broke = seam.feed(data)
    assert not broke
    sent = payloads(out)
    assert sent[-1] == "[DONE]" and ledger.done
    assert [p["id"] for p in sent[:-1]] == ["chatcmpl-1"] * 3
    assert sent[0]["choices"][0]["delta"] == {"content": " more"}
    assert sent[1]["choices"][0]["finish_reason"] == "length"
    # Every reply token counted once, the original prompt as the prompt; of it, what the
    # continuation's engine did not compute (its cached tokens also count the reply so far).
    assert sent[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                                "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    assert ledger.reply_ids == [7, 8, 9, 10] and not ledger.resumable


def test_the_seam_keeps_a_completion_stream_a_completion_stream_and_drops_unasked_usage() -> None:
    ledger = Ledger(chat=False, client_ids=True, prompt_ids=[1], reply_ids=[])
    ledger.shape = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    seam = Seam(ledger, usage=False)
    out, _ = seam.feed(event({"choices": [{"text": "x", "token_ids": [4], "finish_reason": None}]}))
    (sent,) = payloads(out)
    assert sent["choices"][0]["text"] == "x" and sent["choices"][0]["token_ids"] == [4]
    out, _ = seam.feed(event({"choices": [], "usage": {"prompt_tokens": 2}}))
    assert out == b""
    out, broke = seam.feed(event({"error": {"message": "gone", "code": 502}}))
    assert broke and out == b""


async def test_a_migration_is_bounded_and_recovers_text_held_back_at_the_seam() -> None:
    ledger = Ledger(chat=True, client_ids=False, prompt_ids=[1], reply_ids=[65, 66], text=["A"])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def resume(turn: Turn, broken_on: Any) -> Any:
        raise AssertionError("not called here")

    async def detokenize(ids: list[int]) -> str | None:
        return "".join(map(chr, ids)) + "\ufffd"

    migration = Migration(Turn(CHAT, body, "c"), ledger, Seam(ledger, False), 1, resume, detokenize)
    assert await migration.held_text() == "B"
    turn = migration.continuation()
    assert turn is not None and turn.resumes and turn.path == COMPLETIONS
    assert turn.body["prompt"] == [1, 65, 66]
    assert migration.continuation() is None  # the bound: one move


async def test_a_hung_engines_read_is_called_off_and_a_flowing_stream_never_is() -> None:
    """A read from an engine that health checks marked unhealthy and that sent nothing for
    the quiet time is called off (the reply then continues elsewhere); one from a healthy
    engine, or from an unhealthy one whose tokens still flow, waits as long as it takes."""
    engine = Instance("http://decode")
    watch = HangWatch(quiet_s=0.3, every_s=0.05)
    try:

        async def token(after_s: float) -> bytes:
            await asyncio.sleep(after_s)
            return b"data: {}\n\n"

        # Healthy: a slow token is waited for.
        assert await watch.read(lambda: engine, token(0.5)) == b"data: {}\n\n"
        # Marked unhealthy (a busy engine's health check timed out), tokens still flowing.
        engine.healthy = False
        for _ in range(8):
            assert await watch.read(lambda: engine, token(0.1))
        # Then nothing comes: called off once the stream was quiet for 0.3 s.
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await watch.read(lambda: engine, asyncio.Event().wait())
        assert 0.25 <= time.monotonic() - started < 1.0
    finally:
        watch.close()
