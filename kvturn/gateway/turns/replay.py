"""A stream that survives its engine when a continuation cannot carry it: a chat reply that may
call tools (the engine's tool parser holds state no continuation shares) or whose output a
grammar constrains (its state is the whole reply's), replayed from scratch on another engine
and relayed from where the client's stream stopped.

This needs an engine to produce the same reply again, so only a reply sampled reproducibly
is replayed: greedy (``temperature`` 0) or with a ``seed``. The replay is the client's request
as it came, through P/D as a turn of its own (prefill's prefix cache holds its prompt). Its
chunks are checked against what the client was sent, field by field (the content, the
reasoning, and each tool call's name and arguments by index) and only what comes after
that goes out, under the original stream's id; a tool call the client already knows keeps
the id it was announced with. A replay that says anything else where it overlaps what was
sent (it diverged: an engine's batch made a greedy choice differently) is not relayed: the
stream ends with an OpenAI error event, as a stream that cannot move does. The usage a replay
reports counts the whole reply once, as the original would have.

One choice only, no logprobs and no token ids (a chunk the seam cuts in two has text that
can be cut where the client's stopped, but not its ids).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply, SseEvents, failure_event
from kvturn.gateway.tokens import CHAT_PATH
from kvturn.gateway.turns.model import Turn

logger = logging.getLogger("kvturn.gateway")

#: Text fields of a chat delta a replay checks and cuts (vLLM names a reasoning parser's
#: output ``reasoning_content``, or ``reasoning`` in later versions).
TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
#: A chunk's fields that name its stream: a replay's go out under the original's.
SHAPE = ("id", "object", "created", "model")


def replayable(path: str, body: dict[str, Any]) -> bool:
    """Whether a streamed chat request's reply can be replayed from scratch on another engine
    and come out the same: one choice, sampled greedily or with a seed, no logprobs or token
    ids."""
    if path != CHAT_PATH or not body.get("stream"):
        return False
    if (body.get("n") or 1) != 1 or body.get("logprobs") or body.get("top_logprobs"):
        return False
    if body.get("return_token_ids"):
        return False  # a chunk cut at the seam: its text can be cut, its ids cannot
    return body.get("temperature") == 0 or type(body.get("seed")) is int


@dataclass(slots=True)
class ToolCall:
    """One tool call the client was sent, by its index: its id and name, and its arguments so
    far."""

    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Sent:
    """What a replayed stream's client has been sent: the first chunk's ``id``, ``object``,
    ``created`` and ``model`` (a replay's chunks go out under them), the text of each
    :data:`TEXT_FIELDS` field, the tool calls; whether the reply finished, and whether the
    stream ended."""

    shape: dict[str, Any] | None = None
    text: dict[str, str] = field(default_factory=dict)
    tools: dict[int, ToolCall] = field(default_factory=dict)
    finished: bool = False
    done: bool = False
    events: SseEvents = field(default_factory=SseEvents)

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """The complete events of ``chunk`` (with what came before it), relayed as they came;
        and whether one of them is a failure's error event (what follows it is dropped)."""
        out: list[bytes] = []
        for event, payload in self.events.feed(chunk):
            if payload == "done":
                self.done = True
            elif payload is not None and failure_event(payload):
                return b"".join(out), True
            elif payload is not None:
                self.record(payload)
            out.append(event + b"\n\n")
        return b"".join(out), False

    def record(self, payload: dict[str, Any]) -> None:
        if self.shape is None:
            self.shape = {k: payload[k] for k in SHAPE if k in payload}
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            for name in TEXT_FIELDS:
                if isinstance(delta.get(name), str):
                    self.text[name] = self.text.get(name, "") + delta[name]
            for call in delta.get("tool_calls") or ():
                sent = self.tools.setdefault(int(call.get("index") or 0), ToolCall())
                function = call.get("function") or {}
                sent.id = call.get("id") or sent.id
                sent.name = function.get("name") or sent.name
                sent.arguments += function.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finished = True

    @property
    def progress(self) -> str:
        arguments = sum(len(call.arguments) for call in self.tools.values())
        return f"{sum(map(len, self.text.values())) + arguments} characters"

    @property
    def resumable(self) -> bool:
        return not self.finished and not self.done


class Diverged(Exception):
    """A replay said something else where it overlaps what the client was sent."""


class ReplaySeam:
    """A replay's chunks, relayed from where the client's stream stopped (see the module's
    docstring): ``feed`` as the original stream's, plus whether the replay failed (an error
    event of a failure, or a divergence: :attr:`diverged`)."""

    def __init__(self, sent: Sent):
        self.sent = sent
        self.diverged: str | None = None
        self.events = SseEvents()
        self._text: dict[str, int] = {}
        self._args: dict[int, int] = {}

    def restart(self) -> None:
        """A new replay: it starts from the reply's beginning again."""
        self.events = SseEvents()
        self._text.clear()
        self._args.clear()

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        out: list[bytes] = []
        for _, payload in self.events.feed(chunk):
            if payload == "done":
                self.sent.done = True
                out.append(b"data: [DONE]\n\n")
                continue
            if payload is None:
                continue
            if failure_event(payload):
                return b"".join(out), True
            try:
                event = self.reshape(payload)
            except Diverged as why:
                self.diverged = str(why)
                logger.warning("a replayed reply diverged from what was sent: %s", why)
                return b"".join(out), True
            if event:
                out.append(event)
        return b"".join(out), False

    def reshape(self, payload: dict[str, Any]) -> bytes:
        """The original stream's event for one replay payload (``b""``: nothing new)."""
        choices = []
        for choice in payload.get("choices") or ():
            delta = self._new(choice.get("delta") or {})
            finish = choice.get("finish_reason")
            if finish:
                self._caught_up()
                self.sent.finished = True
            if delta or finish:
                choices.append({**choice, "delta": delta})
        if not choices and not payload.get("usage"):
            return b""
        reshaped = {**payload, **(self.sent.shape or {}), "choices": choices}
        return b"data: " + orjson.dumps(reshaped) + b"\n\n"

    def _new(self, delta: dict[str, Any]) -> dict[str, Any]:
        """What of a replay's delta the client has not been sent (its role, always)."""
        new: dict[str, Any] = {}
        for name in TEXT_FIELDS:
            text = delta.get(name)
            if isinstance(text, str) and text:
                at = self._text.get(name, 0)
                rest = _past(self.sent.text.get(name, ""), at, text, name)
                self._text[name] = at + len(text)
                if rest:
                    self.sent.text[name] = self.sent.text.get(name, "") + rest
                    new[name] = rest
        calls = [c for c in map(self._new_call, delta.get("tool_calls") or ()) if c]
        if calls:
            new["tool_calls"] = calls
        return new

    def _new_call(self, call: dict[str, Any]) -> dict[str, Any] | None:
        index = int(call.get("index") or 0)
        function = call.get("function") or {}
        sent = self.sent.tools.get(index)
        new: dict[str, Any] = {"index": index}
        name = function.get("name")
        if sent is not None and sent.name is not None:
            if name and name != sent.name:
                raise Diverged(f"tool call {index} named {name!r}, sent as {sent.name!r}")
        elif name or call.get("id"):
            # Announced now, for the first time: under the replay's id.
            sent = self.sent.tools.setdefault(index, ToolCall())
            sent.id, sent.name = call.get("id") or sent.id, name or sent.name
            new.update({k: v for k, v in call.items() if k not in ("index", "function")})
            new["function"] = {"name": name} if name else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            sent = self.sent.tools.setdefault(index, ToolCall())
            at = self._args.get(index, 0)
            rest = _past(sent.arguments, at, arguments, f"tool call {index}'s arguments")
            self._args[index] = at + len(arguments)
            if rest:
                sent.arguments += rest
                new.setdefault("function", {})["arguments"] = rest
        return new if len(new) > 1 else None

    def _caught_up(self) -> None:
        """At the replay's finish: it must have said at least all that was sent."""
        for name, text in self.sent.text.items():
            if self._text.get(name, 0) < len(text):
                raise Diverged(f"the replay's {name} ended before what was sent")
        for index, call in self.sent.tools.items():
            if self._args.get(index, 0) < len(call.arguments):
                raise Diverged(f"the replay's tool call {index} ended before what was sent")


def _past(sent: str, at: int, text: str, what: str) -> str:
    """What of ``text``, a replay's next piece of a field from offset ``at``, lies past what
    the client was sent (``sent``); :class:`Diverged` where the two disagree."""
    overlap = sent[at : at + len(text)]
    if not text.startswith(overlap):
        raise Diverged(f"{what} at {at}: {text[:16]!r}, sent {overlap[:16]!r}")
    return text[len(overlap) :]


@dataclass(slots=True)
class Replay:
    """A replayable stream's means to continue (:class:`~.relay.Relay` uses it as it uses a
    :class:`~.migrate.Migration`): the turn as the client sent it, what was sent of its
    reply, how many times it may still move."""

    turn: Turn
    ledger: Sent
    seam: ReplaySeam
    limit: int
    #: Serves the replay through P/D on a decode other than the given one.
    resume: Callable[[Turn, Instance | None], Awaitable[Reply]]
    used: int = 0

    def continuation(self) -> Turn | None:
        """The replay's turn, or ``None`` where it cannot (bound reached, the reply over, a
        replay that diverged)."""
        if self.used >= self.limit or not self.ledger.resumable or self.seam.diverged:
            return None
        self.used += 1
        self.seam.restart()
        turn = self.turn
        return Turn(
            turn.path, dict(turn.body), None, tenant=turn.tenant, request_id=turn.request_id,
            trace_headers=turn.trace_headers, tracer=turn.tracer, resumes=True,
            digests=turn.message_digests(),
        )  # fmt: skip

    async def held_event(self) -> bytes:
        """Nothing: a replay's text is all its own."""
        return b""
