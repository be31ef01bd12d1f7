"""A stream that survives its engine: when decode's stream breaks off after the reply has begun
(its connection lost, or an error event of a failure) or its engine hangs (health checks mark
it unhealthy and nothing came for a health interval: :class:`~.relay.HangWatch`), the same
client stream continues on another engine from the prompt plus the tokens already sent, as
Dynamo's request migration does (``--migration-limit``).

Exactness rests on token ids, never on re-tokenized text: a migratable stream asks its engine
for them (vLLM's ``return_token_ids``: the prompt's ids in the first chunk, each chunk's new
ids beside its text), the :class:`Ledger` keeps them, and the continuation is a completion
request whose prompt is those ids (prompt then reply so far), with ``max_tokens`` reduced by
what was sent and the request's other sampling settings kept (a set seed advances by the tokens
sent). It goes through P/D as a turn of its own: prefill's prefix cache holds the prompt it
computed for the turn, so only the reply so far is computed again. Its chunks reach the client
in the original stream's shape (:class:`Seam`): chat chunks for a chat stream, under the
original id; the usage counts every completion token once.

What a continuation cannot carry faithfully is not continued: more than one choice (``n``),
logprobs, structured output, tools the model may call (the engine's tool parser holds state no
continuation shares), presence or frequency penalties (they count the reply so far, which a
continuation sees as prompt), completion ``echo``/``suffix``. Of those, a chat reply sampled
reproducibly is replayed from scratch instead (:mod:`.replay`); any other such stream that
breaks ends with an OpenAI error event. A stop string that would span the seam is not
seen. Text the engine held back (an incomplete character) is recovered at the seam by
detokenizing the ids sent. The ids are exact; the text is the engine's rendering of them, and
where the reply so far is bytes that are not valid UTF-8 (a model emitting U+FFFD), vLLM's
detokenizer (tokenizers' ``DecodeStream``, primed with the whole prompt) may render the
characters after the seam differently from an uninterrupted stream.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply, SseEvents, failure_event
from kvturn.gateway.tokens import CHAT_PATH, COMPLETIONS_PATH
from kvturn.gateway.turns.model import Turn

logger = logging.getLogger("kvturn.gateway")

#: Sampling and output fields a completion continuation keeps as the request had them.
CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "priority",
    "user",
)
#: Request fields whose effect a continuation cannot reproduce (see the module's docstring).
_NOT_CARRIED = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "suffix",
    "best_of",
)


def migratable(path: str, body: dict[str, Any]) -> bool:
    """Whether a streamed request's reply can continue on another engine (the module's
    docstring says what cannot)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH) or not body.get("stream"):
        return False
    if (body.get("n") or 1) != 1 or any(body.get(k) for k in _NOT_CARRIED):
        return False
    if path == CHAT_PATH:
        return not body.get("tools") or body.get("tool_choice") == "none"
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(type(t) is int for t in prompt)
    )


@dataclass(slots=True)
class Ledger:
    """What a migratable stream has sent its client: the prompt's and the reply's token ids,
    the reply's text, whether it finished; and the stream's chunks, rewritten where the client
    did not ask for token ids (vLLM's ``return_token_ids`` was the gateway's, not theirs)."""

    chat: bool
    #: The client asked for token ids itself: they stay in the chunks.
    client_ids: bool
    #: The first chunk's ``id``, ``object``, ``created``, ``model``: a continuation's chunks
    #: go out under them.
    shape: dict[str, Any] | None = None
    prompt_ids: list[int] | None = None
    reply_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finished: bool = False
    done: bool = False
    events: SseEvents = field(default_factory=SseEvents)

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """The complete events of ``chunk`` (with what came before it), to relay; and whether
        one of them is a failure's error event (what follows it is dropped: the stream
        continues elsewhere, or ends with an error event of the gateway's)."""
        out: list[bytes] = []
        for event, payload in self.events.feed(chunk):
            if payload is not None and payload != "done" and failure_event(payload):
                return b"".join(out), True
            kept = self._event(event, payload)
            if kept:
                out.append(kept)
        return b"".join(out), False

    def _event(self, event: bytes, payload: Any) -> bytes:
        """The event to relay (``b""``: nothing) for one of the stream's events and its data
        (:class:`~kvturn.gateway.replies.SseEvents`); never a failure's."""
        if payload == "done":
            self.done = True
        if not isinstance(payload, dict) or "error" in payload:
            return event + b"\n\n"  # not a chunk, or an error about the request itself
        if self.shape is None:
            self.shape = {
                k: payload[k] for k in ("id", "object", "created", "model") if k in payload
            }
        prompt_ids = payload.get("prompt_token_ids")
        if isinstance(prompt_ids, list):
            self.prompt_ids = prompt_ids
        said = bool(payload.get("usage"))
        for choice in payload.get("choices") or ():
            if isinstance(choice.get("prompt_token_ids"), list):  # a completion stream's place
                self.prompt_ids = prompt_ids = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.reply_ids.extend(ids)
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                self.text.append(text)
            if choice.get("finish_reason"):
                self.finished = True
            said = said or bool(text) or bool(choice.get("finish_reason"))
            said = said or any(v for k, v in (choice.get("delta") or {}).items() if k != "content")
        if self.client_ids:
            return event + b"\n\n"
        # As vLLM answers a request that did not ask for ids: the same fields, null.
        if "prompt_token_ids" in payload:
            payload["prompt_token_ids"] = None
        choices = payload.get("choices") or ()
        for choice in choices:
            for key in ("token_ids", "prompt_token_ids"):
                if key in choice:
                    choice[key] = None
        only_ids = all(c.get("delta") == {} and c.get("logprobs") is None for c in choices)
        if self.chat and choices and not said and prompt_ids is None and only_ids:
            return b""  # a chunk only for its ids: vLLM sends none without them
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    @property
    def progress(self) -> str:
        return f"{len(self.reply_ids)} tokens"

    @property
    def resumable(self) -> bool:
        """The ids a continuation needs are known, and the reply is not over."""
        return self.prompt_ids is not None and not self.finished and not self.done


def continuation_body(body: dict[str, Any], ledger: Ledger) -> dict[str, Any] | None:
    """The completion request that continues the reply (prompt ids then reply ids), or
    ``None`` where nothing is left to generate."""
    assert ledger.prompt_ids is not None
    sent = len(ledger.reply_ids)
    cont: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
    cont["prompt"] = [*ledger.prompt_ids, *ledger.reply_ids]
    cont["stream"] = True
    cont["stream_options"] = {"include_usage": True}
    cont["return_token_ids"] = True
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int):
        if limit - sent <= 0:
            return None
        cont["max_tokens"] = limit - sent
    if isinstance(body.get("min_tokens"), int):
        cont["min_tokens"] = max(0, body["min_tokens"] - sent)
    if isinstance(body.get("seed"), int):
        cont["seed"] = body["seed"] + sent  # the draws after the seam are not the first ones
    return cont


def wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


class Seam:
    """A continuation's completion chunks, reshaped as the original stream's: its chat or
    completion chunks under the original id, every new token recorded in the ledger, the
    usage (if the client asked for it) counting the original prompt and every reply token."""

    def __init__(self, ledger: Ledger, usage: bool):
        self.ledger = ledger
        self.usage = usage
        self.events = SseEvents()

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """The original stream's events for a continuation's ``chunk``, and whether it
        reported a failure (an error event of a 5xx: what follows is dropped)."""
        out: list[bytes] = []
        for event, payload in self.events.feed(chunk):
            if payload == "done":
                self.ledger.done = True
                out.append(b"data: [DONE]\n\n")
                continue
            if payload is None:
                continue
            if failure_event(payload):
                return b"".join(out), True
            # An error about the request itself is the client's, as it came.
            out.append(event + b"\n\n" if "error" in payload else self.reshape(payload))
        return b"".join(out), False

    def reshape(self, payload: dict[str, Any]) -> bytes:
        """The original stream's event for one continuation payload (``b""``: none)."""
        ledger = self.ledger
        shape = ledger.shape or {}
        if payload.get("usage") and not payload.get("choices"):
            if not self.usage:
                return b""
            prompt = len(ledger.prompt_ids or ())
            usage = {
                **payload["usage"],
                "prompt_tokens": prompt,
                "completion_tokens": len(ledger.reply_ids),
                "total_tokens": prompt + len(ledger.reply_ids),
            }
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and "cached_tokens" in details:
                # As vLLM counts them for any P/D reply (prefill's own prefix-cache hits, which
                # decode reports), of the original prompt: the continuation's prompt also
                # holds the reply so far.
                cached = min(int(details["cached_tokens"] or 0), prompt)
                usage["prompt_tokens_details"] = {**details, "cached_tokens": cached}
            return self._event({**shape, "choices": [], "usage": usage})
        choices = []
        for choice in payload.get("choices") or ():
            ids = choice.get("token_ids") if isinstance(choice.get("token_ids"), list) else []
            ledger.reply_ids.extend(ids)
            text = choice.get("text") or ""
            if text:
                ledger.text.append(text)
            finish = choice.get("finish_reason")
            if finish:
                ledger.finished = True
            if not (text or finish or (ledger.client_ids and ids)):
                continue
            shaped: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if ledger.chat:
                shaped["delta"] = {"content": text} if text else {}
            else:
                shaped["text"] = text
            if finish and choice.get("stop_reason") is not None:
                shaped["stop_reason"] = choice["stop_reason"]
            shaped["token_ids"] = ids if ledger.client_ids else None  # as vLLM sends it
            choices.append(shaped)
        return self._event({**shape, "choices": choices}) if choices else b""

    def text_event(self, text: str) -> bytes:
        """An event carrying text the engine held back before the seam."""
        if self.ledger.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        self.ledger.text.append(text)
        return self._event({**(self.ledger.shape or {}), "choices": [choice]})

    @staticmethod
    def _event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(slots=True)
class Migration:
    """A migratable stream's means to continue (:class:`~.relay.Relay` uses it): the turn as
    the client sent it, what was sent of its reply, how many times it may still move."""

    turn: Turn
    ledger: Ledger
    seam: Seam
    limit: int
    #: Serves a continuation turn through P/D on a decode other than the given one
    #: (:meth:`~.runner.TurnRunner.resume`).
    resume: Callable[[Turn, Instance | None], Awaitable[Reply]]
    #: The text of token ids (an engine's ``/detokenize``), ``None`` if none can say.
    detokenize: Callable[[list[int]], Awaitable[str | None]]
    used: int = 0

    def continuation(self) -> Turn | None:
        """The turn that continues the reply, or ``None`` where it cannot (bound reached, ids
        unknown, nothing left to generate)."""
        if self.used >= self.limit or not self.ledger.resumable:
            return None
        body = continuation_body(self.turn.body, self.ledger)
        if body is None:
            return None
        self.used += 1
        turn = self.turn
        # Placed as the turn was (its messages' digests): that prefill's cache holds the prompt.
        return Turn(
            COMPLETIONS_PATH, body, None, tenant=turn.tenant, request_id=turn.request_id,
            trace_headers=turn.trace_headers, tracer=turn.tracer, resumes=True,
            digests=turn.message_digests(),
        )  # fmt: skip

    async def held_event(self) -> bytes:
        """An event of the text the engine held back at the seam (``b""``: none)."""
        held = await self.held_text()
        return self.seam.text_event(held) if held else b""

    async def held_text(self) -> str:
        """Text of the ids sent that the engine had not sent yet (held back at the seam)."""
        sent = "".join(self.ledger.text)
        full = await self.detokenize(self.ledger.reply_ids) if self.ledger.reply_ids else None
        if full is None or not full.startswith(sent):
            return ""
        return full[len(sent) :].rstrip("\ufffd")
