"""Where a streamed decode reply starts (``kvturn.gateway.turns.relay.reply_start``): the gateway
reads vLLM's stream up to its first event that says more than the reply's role, so that a
failure reported inside the stream before any token (an error event) can be served again."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvturn.gateway.http.pool import HttpError
from kvturn.gateway.http.upstream import UpstreamUnavailable
from kvturn.gateway.turns.relay import reply_start


class Stream:
    """The part of a stream response ``reply_start`` reads: its chunks as they arrived."""

    def __init__(self, chunks: list[bytes], broken: bool = False):
        self.chunks = list(chunks)
        self.broken = broken
        self.read = 0

    async def next_chunk(self) -> bytes | None:
        if not self.chunks:
            if self.broken:
                raise HttpError("connection reset")
            return None
        self.read += 1
        return self.chunks.pop(0)


def event(payload: Any) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return event({"id": "x", "object": "chat.completion.chunk", "choices": [choice]})


ROLE = chunk({"role": "assistant", "content": ""})
TOKEN = chunk({"content": "ok"})
ERROR = event({"error": {"message": "Internal server error", "code": 500}})
DONE = b"data: [DONE]\n\n"


def start(stream: Stream) -> list[bytes] | None:
    return asyncio.run(reply_start(stream))  # type: ignore[arg-type]


def test_the_reply_starts_at_its_first_token_and_nothing_after_it_is_read() -> None:
    stream = Stream([ROLE, TOKEN, chunk({"content": "!"}), DONE])
    assert start(stream) == [ROLE, TOKEN]
    assert stream.read == 2


def test_an_error_before_any_token_is_a_failed_decode() -> None:
    assert start(Stream([ROLE, ERROR, DONE])) is None
    assert start(Stream([ROLE + ERROR + DONE])) is None  # in one read
    assert start(Stream([b": keep-alive\n\n", ERROR])) is None


def test_an_error_about_the_request_itself_is_the_replys_own() -> None:
    # A 4xx inside the stream says the same on any engine: relayed, not served again.
    refused = event({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    assert start(Stream([ROLE, refused, DONE])) == [ROLE, refused]


def test_an_error_after_a_token_is_the_replys_own() -> None:
    # Bytes have reached the client by then: relayed as they came, never retried.
    assert start(Stream([ROLE + TOKEN + ERROR])) == [ROLE + TOKEN + ERROR]


@pytest.mark.parametrize(
    "first",
    [
        chunk({"content": "ok"}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}),
        chunk({}, finish="length"),
        event({"id": "x", "choices": [], "usage": {"completion_tokens": 0}}),
        DONE,
        b"data: not json\n\n",
        b'event: response.created\ndata: {"type": "response.created"}\n\n',
    ],
)
def test_whatever_says_more_than_the_role_starts_the_reply(first: bytes) -> None:
    assert start(Stream([ROLE, first, TOKEN])) == [ROLE, first]


def test_an_event_split_across_reads_is_judged_whole() -> None:
    assert start(Stream([ROLE, ERROR[:9], ERROR[9:]])) is None
    assert start(Stream([ROLE, TOKEN[:5], TOKEN[5:], DONE])) == [ROLE, TOKEN[:5], TOKEN[5:]]


def test_a_stream_that_ends_or_breaks_before_any_token() -> None:
    assert start(Stream([ROLE])) == [ROLE]  # ended: relayed as it is
    with pytest.raises(UpstreamUnavailable):
        start(Stream([ROLE], broken=True))
