"""What a turn's collaborators pass each other: the turn as received, what planning decided
about the previous KV, what decode needs after prefill; and the shaping of the requests the
engines get."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace

from kvturn import headers as h
from kvturn.gateway import tracing
from kvturn.gateway.batches import BATCH_WINDOW
from kvturn.gateway.digests import message_digests, salt_digest, seed
from kvturn.gateway.planner import TurnPlan
from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply
from kvturn.gateway.tokens import CHAT_PATH
from kvturn.wire import PREFILL_FOR_REMOTE_DECODE

#: What prefill gets when nothing is reused: compute, and keep the KV for decode to pull.
RECOMPUTE_PARAMS = PREFILL_FOR_REMOTE_DECODE
#: A caller's ``X-Request-Id`` that the engines' request ids may start with: what travels
#: safely inside vLLM's ids, NIXL's notifications and the connector's lease keys.
_FORWARDED_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: Sampling fields that only matter for the reply, dropped from the prefill request.
_DECODE_ONLY_FIELDS = ("max_completion_tokens", "stream_options", "min_tokens", "n")


@dataclass(slots=True)
class Turn:
    """One request as the gateway received it."""

    path: str
    body: dict[str, Any]
    conversation_id: str | None
    #: The client's turn id (``X-Kvturn-Turn-Id``), the same on every retry of one turn.
    turn_id: str | None = None
    started: float = field(default_factory=time.perf_counter)
    #: The pause the client reported before this turn: (kind, milliseconds).
    pause: tuple[str, float] | None = None
    #: The client beats through the pause after this turn (``X-Kvturn-Heartbeats``): its
    #: lease is the heartbeat lease.
    heartbeats: bool = False
    #: The caller's tenant (``""`` on an open gateway): conversations are its own.
    tenant: str = ""
    #: For a turn of an implicit conversation: the digest of its messages, which its reply
    #: extends into the key the next turn (or a fork) is found by.
    implicit: bytes | None = None
    #: For a chat turn of a conversation with an id: the digest of its messages, which its
    #: forks find it by (:func:`~kvturn.gateway.digests.prompt_key`; ``None``: not indexed).
    prompt_digest: bytes | None = None
    #: Another turn's KV this turn's prompt starts with, which it may read without taking
    #: it (:class:`Source`; found by :meth:`~.reuse.ReuseStep.find_source`).
    source: Source | None = None
    #: The conversation table could not be reached: the turn recomputes, keeping nothing.
    state_unavailable: bool = False
    #: A chat turn's chained message digests (see :meth:`message_digests`).
    digests: list[bytes] | None = None
    #: The caller's ``X-Request-Id``, if any (echoed on the reply; the engines' request ids
    #: start with it where it travels safely).
    request_id: str | None = None
    #: The caller's W3C trace context (``traceparent``, ``tracestate``), carried to the engines.
    trace_headers: dict[str, str] = field(default_factory=dict)
    #: The gateway's tracer, when it traces (:mod:`kvturn.gateway.tracing`).
    tracer: trace.Tracer | None = None
    #: A broken stream's continuation (:mod:`.migrate`): its own break is its parent's to
    #: handle, and it keeps no KV.
    resumes: bool = False
    #: A batch of prompts: how many of them may have engine requests in flight at once
    #: (:func:`~kvturn.gateway.batches.serve_batch`; what its tenant had left).
    window: int = BATCH_WINDOW
    #: What the conversation keeps of the request's ``cache_salt``
    #: (:func:`~kvturn.gateway.digests.salt_digest`): its KV is reused only under the same.
    salt: bytes | None = field(init=False)

    def __post_init__(self) -> None:
        self.salt = salt_digest(self.body.get("cache_salt"))

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def engine_request_id(self) -> str:
        """A new id for one engine request of this turn: 128 random bits (decode publishes the
        KV it retains under it, and the reply's id is made of it), after the caller's
        ``X-Request-Id`` where that travels safely, so the engines' logs and traces name it."""
        drawn = f"kvturn-{os.urandom(16).hex()}"
        given = self.request_id
        if given is not None and _FORWARDED_REQUEST_ID.fullmatch(given):
            return f"{given}-{drawn}"
        return drawn

    def engine_headers(
        self, request_id: str, trace_context: otel_context.Context | None = None
    ) -> dict[str, str]:
        """The headers of an engine request of this turn: its id, and the trace it is part of:
        the gateway's current span (or ``trace_context``'s) when tracing is on, else the
        caller's trace context as it came."""
        if self.tracer is None:
            return {h.REQUEST_ID: request_id, **self.trace_headers}
        headers = {h.REQUEST_ID: request_id}
        tracing.inject(headers, trace_context)
        return headers

    def message_digests(self) -> list[bytes]:
        """Digest ``i`` commits to the tenant, model, cache salt and messages ``0..i``
        (:func:`~kvturn.gateway.digests.message_digests`); computed once. Empty for a request
        without chat messages."""
        if self.digests is None:
            messages = self.body.get("messages")
            if self.path != CHAT_PATH or not isinstance(messages, list):
                self.digests = []
            else:
                start = seed(self.tenant, self.body.get("model"), self.body.get("cache_salt"))
                self.digests = message_digests(start, messages)
        return self.digests


@dataclass(frozen=True, slots=True)
class Source:
    """Live KV that a turn's prompt starts with and that the turn reads through its holder
    decode's prefix cache, never taking it: the context a fork or subagent shares with its
    parent conversation, or the history a parallel turn shares with the sibling that took
    the conversation's KV. The turn gets a lease of its own; the owner keeps its own."""

    #: ``fork``: another conversation's turn (or an older turn of one that moved on);
    #: ``parallel``: this conversation's KV, taken by a turn still in flight.
    kind: Literal["fork", "parallel"]
    holder_url: str
    #: What the prompt must start with (a turn's verified prompt prefix) and its tokens.
    digest: str
    digest_tokens: int
    #: When the owner's lease lapses (the table's clock; 0: in use by a turn in flight).
    expires_at: float = 0.0


@dataclass(slots=True)
class Uncounted:
    """A ``decode-local`` turn planned from a bound on its new tokens
    (:mod:`kvturn.gateway.extension`), not from counting them: the count comes after the
    reply, off the response path, and checks the bound."""

    path: str
    body: dict[str, Any]
    #: At most this many tokens past ``covered`` were to be computed by the holder.
    bound: int
    #: The prefix of the held prompt its digest verifies (tokens), and that digest.
    covered: int
    digest: str | None
    #: Seconds to the first token (the holder's local prefill), once streamed.
    first_token_s: float | None = None


@dataclass(slots=True)
class Reuse:
    """What planning decided about the conversation's previous KV."""

    plan: TurnPlan
    #: ``kv_transfer_params`` for prefill: plain P/D, or a claimed lease to pull.
    params: dict[str, Any] = field(default_factory=lambda: RECOMPUTE_PARAMS)
    #: The lease this turn holds on the previous KV while prefill reads it: (holder, key).
    claimed: tuple[Instance, str] | None = None
    #: ``decode-local``: the holder, and the lease its new turn supersedes.
    holder: Instance | None = None
    previous_key: str | None = None
    #: The prompt's tokens and those the holder's cache covers (``decode-local``).
    prompt_tokens: int = 0
    reused_tokens: int = 0
    uncounted: Uncounted | None = None
    #: The name decode's connector leases the turn's KV under, where it is not the
    #: conversation's (a parallel turn: its lease must not end its sibling's on the engine;
    #: the table keeps the one of the turn begun last, :mod:`kvturn.gateway.state.table`).
    lease_name: str | None = None
    #: A holder whose control server did not answer the claim: this turn's decode goes
    #: elsewhere (its engine likely shares its fate; health checks tell the other turns).
    avoid: Instance | None = None


@dataclass(slots=True)
class PrefillResult:
    """What decode needs after prefill (or, for ``decode-local``, instead of it)."""

    #: The prefill engine (``None``: no prefill ran, the turn is ``decode-local``).
    instance: Instance | None
    params: dict[str, Any]
    prompt_tokens: int
    reused_tokens: int
    plan: TurnPlan
    #: When prefill answered (perf_counter; for the costs decode adds after it).
    finished_at: float = 0.0
    #: A ``decode-local`` turn planned from a bound: its tokens are counted after the reply.
    uncounted: Uncounted | None = None


class DecodeFailed(Exception):
    """Decode failed before sending a byte of its reply: the turn can still be retried."""

    def __init__(self, url: str, *, unreachable: bool):
        super().__init__(f"{url} {'unreachable' if unreachable else 'answered 5xx'}")
        self.url = url
        self.unreachable = unreachable


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The request prefill gets for a turn: one token, not streamed, carrying ``params``."""
    prefill = {k: v for k, v in body.items() if k not in _DECODE_ONLY_FIELDS}
    if body.get("temperature") == 0 and "n" in body:
        # Greedy sampling refuses n > 1: let prefill's own validation say so before any work.
        prefill["n"] = body["n"]
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = dict(params)
    return prefill


def prioritized(body: dict[str, Any], priority: int) -> dict[str, Any]:
    """A pull's prefill request, which computes only the turn's new suffix, with vLLM's
    scheduling ``priority`` (lower: sooner; ``GatewayConfig.pull_priority``): on a prefill
    engine that schedules by priority it runs before the whole-history recomputes queued
    there. A priority the client set is its own and kept."""
    if priority and "priority" not in body:
        body["priority"] = priority
    return body


def passthrough(status: int, payload: bytes, headers: dict[str, str] | None = None) -> Reply:
    """An engine's own answer (a 4xx the client must see), as it came."""
    return Reply(status, payload, headers or {})


def status_text(response: Any) -> str:
    return "unreachable" if response is None else f"HTTP {response.status}"
