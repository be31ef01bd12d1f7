"""Sharing: a turn that has no KV of its own to reuse reads KV another turn owns, through
the prefix cache of the decode holding it, never taking it.

- **Forks and subagents.** A request whose messages extend a recent turn of another
  conversation (a subagent started from its parent's context under an id of its own, or none),
  or an older turn of a conversation that has moved on, finds that turn in the index
  (:mod:`kvturn.gateway.state.implicit`, with where its KV stayed and the digest of its
  verified prompt prefix: a named conversation's turns by their messages,
  :func:`~kvturn.gateway.digests.prompt_key`; an implicit one's by messages and reply). Where that
  conversation still leases KV that extends the turn, the request is served ``decode-local``
  on that decode; the parent keeps its lease, and the fork's turn gets one of its own.
- **Parallel turns.** Two turns of one conversation in flight at once (parallel tool-call
  follow-ups, a retry racing the original): the first takes the conversation's KV; the second
  finds its own conversation's last turn in the index while that KV is taken by a turn not yet
  recorded, and is served on the same decode. Its lease goes under a name of its own on the
  engine (:attr:`~.model.Reuse.lease_name`), so neither ends the other's there; the table
  keeps the one of the turn begun last (fencing by turn number), and the other is freed.

No pull is ever planned on shared KV: NIXL frees a lease's blocks after one read. vLLM's prefix
cache matches exact token ids, so a source that turns out not to cover what the index said
costs a longer local prefill, never an answer.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from kvturn.gateway.digests import prompt_key
from kvturn.gateway.errors import NoHealthyEngine
from kvturn.gateway.planner import SharedInputs, choose_shared
from kvturn.gateway.state.implicit import Indexed
from kvturn.gateway.state.table import Conversation
from kvturn.gateway.tokens import CHAT_PATH, prompt_token_ids
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.model import Reuse, Source, Turn
from kvturn.gateway.turns.placement import choose_prefill, counter
from kvturn.wire import DIGEST_CHUNK_TOKENS, last_prefix_digest


class Sharing:
    """Finds a turn's :class:`~.model.Source` and plans the turn on it (see the module's
    docstring)."""

    def __init__(self, context: TurnContext):
        self.context = context

    async def find_source(self, turn: Turn, conversation: Conversation) -> None:
        """For a turn with no KV of its own to reuse (a new conversation, or one whose KV a
        turn still in flight took): the most recent turn its messages extend, if its KV is
        live on a decode, as :attr:`~.model.Turn.source`. One index lookup (and, for another
        conversation's turn, one read of its entry)."""
        if conversation.holder_url is not None or not self.context.config.shared_prefixes:
            return
        if indexed_digest(turn) is None:
            return
        candidates = shared_candidates(turn)
        found = await self.context.store.implicit.match(candidates) if candidates else None
        if found is None:
            return
        if found.key != conversation.key:
            # Another conversation's turn: where that conversation's KV is now (a lease that
            # extends the turn's, or the turn's own while a newer turn takes it).
            entry = await self.context.store.snapshot(found.key)
            turn.source = self.source_of(turn, found, entry) if entry is not None else None
        elif conversation.turns - 1 > conversation.recorded_turn:
            # Its own KV, taken by an earlier turn not yet recorded: a parallel turn.
            turn.source = self.source_of(turn, found, None, kind="parallel")

    def source_of(
        self,
        turn: Turn,
        found: Indexed,
        entry: Conversation | None,
        kind: Literal["fork", "parallel"] = "fork",
    ) -> Source | None:
        """The KV a turn extending ``found`` may share: where ``entry`` (the conversation of
        ``found``, as it is now) keeps a live lease on KV that extends it; or, while a turn
        of that conversation is in flight on it (``entry`` ``None``: this turn's own
        conversation), where ``found`` left it."""
        if found.digest is None or found.holder_url is None:
            return None
        if entry is None:
            return Source(kind, found.holder_url, found.digest, found.digest_tokens)
        now = self.context.store.clock()
        if entry.has_live_kv(now, self.context.config.expiry_margin_s):
            if entry.held_salt != turn.salt or entry.holder_url is None:
                return None
            holder = entry.holder_url
            return Source(kind, holder, found.digest, found.digest_tokens, entry.lease_expires_at)
        if entry.holder_url is None and entry.turns > entry.recorded_turn:
            return Source(kind, found.holder_url, found.digest, found.digest_tokens)
        return None

    async def plan(
        self, turn: Turn, source: Source, conversation: Conversation | None
    ) -> Reuse | None:
        """``decode-local`` on the decode holding ``source`` (:func:`~.planner.choose_shared`),
        from the prompt's exact token ids, if they start with the source's verified prefix;
        ``None``: the turn is planned as if there were no source."""
        holder = self.context.decode.get(source.holder_url)
        limits = self.context.limits
        if holder is None or not holder.healthy or holder.draining or not limits.enabled:
            return None
        now = self.context.store.clock()
        if source.expires_at and now + self.context.config.expiry_margin_s >= source.expires_at:
            return None
        if holder.in_flight >= limits.max_running:
            return None
        started = time.perf_counter()
        ids = await prompt_token_ids(
            self.context.upstream, counter(self.context.prefill, holder).url, turn.path, turn.body
        )
        self.context.metrics.count_seconds.observe(time.perf_counter() - started)
        if ids is None:
            return None
        if last_prefix_digest(ids, source.digest_tokens, DIGEST_CHUNK_TOKENS) != source.digest:
            return None
        # Whole blocks of the verified prefix; the last prompt token is always computed.
        covered = min(source.digest_tokens, max(0, len(ids) - 1))
        if holder.block_size:
            covered -= covered % holder.block_size
        try:
            prefill_url = choose_prefill(self.context.prefill, turn).url
        except NoHealthyEngine:
            prefill_url = ""
        inputs = SharedInputs(
            source.kind, len(ids), covered, holder.in_flight, holder.url, prefill_url
        )
        threshold = self.context.config.reuse_threshold_tokens
        plan = choose_shared(inputs, limits, self.context.costs, threshold)
        if plan is None:
            return None
        lease_name = None
        if source.kind == "parallel" and conversation is not None:
            lease_name = f"{conversation.key}#{os.urandom(6).hex()}"
        return Reuse(
            plan,
            holder=holder,
            prompt_tokens=len(ids),
            reused_tokens=covered,
            lease_name=lease_name,
        )


def indexed_digest(turn: Turn) -> bytes | None:
    """What a chat turn is indexed by, once its reply extends it: the digest of its messages
    (``None``: not a single-choice chat turn; which choice comes back next is not known)."""
    messages = turn.body.get("messages")
    if turn.path != CHAT_PATH or not isinstance(messages, list) or not messages:
        return None
    if (turn.body.get("n") or 1) != 1:
        return None
    return turn.message_digests()[-1]


def shared_candidates(turn: Turn) -> list[bytes]:
    """What a turn's forkable prefixes are indexed by, shortest first: before each reply in
    its messages, the prompt that reply answered (a named conversation's turn,
    :func:`~kvturn.gateway.digests.prompt_key`) and that prompt with the reply (an implicit
    one's)."""
    messages = turn.body.get("messages") or []
    digests = turn.message_digests()
    found: list[bytes] = []
    for i, message in enumerate(messages):
        if is_reply(message):
            if i:
                found.append(prompt_key(digests[i - 1]))
            found.append(digests[i])
    return found


def reply_ends(turn: Turn) -> list[bytes]:
    """The digests of the turn's message prefixes that end with a reply: only those can be a
    recorded turn's messages plus its reply."""
    messages = turn.body.get("messages") or []
    return [d for d, m in zip(turn.message_digests(), messages, strict=True) if is_reply(m)]


def is_reply(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"
