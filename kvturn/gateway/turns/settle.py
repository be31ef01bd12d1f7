"""After a turn's reply: counting it, recording where the conversation's KV now lives, and
freeing what nobody can come back for.

A reply under way (a stream), or one whose record must first ask decode where its KV stays, is
*marked* in the table first (:meth:`Settlement.mark_settling`): the conversation's next turn
waits for its record a while. The record itself (:meth:`Settlement.settle`) runs off the
response path; it is fenced by the turn's number in the table (:mod:`kvturn.gateway.state.table`),
and what it replaces, or what a newer turn made useless, is freed on its decode.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from kvturn.gateway.digests import extend, prompt_key
from kvturn.gateway.errors import StateUnavailable
from kvturn.gateway.extension import BOUNDARY_TOKENS, prompt_mark
from kvturn.gateway.pools import Instance
from kvturn.gateway.state.implicit import Indexed
from kvturn.gateway.state.table import Held, Recorded, Taken
from kvturn.gateway.tokens import prompt_token_ids
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.model import PrefillResult, Turn
from kvturn.gateway.turns.placement import counter
from kvturn.wire import (
    BLOCK_SIZE_KEY,
    DIGEST_CHUNK_TOKENS,
    EXPIRES_IN_KEY,
    KV_BYTES_PER_TOKEN_KEY,
    PREFIX_DIGESTS_KEY,
    PROMPT_TOKENS_KEY,
    last_prefix_digest,
)

logger = logging.getLogger("kvturn.gateway")


@dataclass(slots=True)
class After:
    """What the gateway records once a turn's reply is over."""

    taken: Taken | None
    #: The decode that served the turn and may retain its KV (``None``: it retains nothing).
    holder: Instance | None
    request_id: str
    #: ``decode-local``: the lease the new one supersedes on the same decode.
    supersedes: str | None
    #: An implicit conversation's turn: the digest of its messages (the reply extends it into
    #: what the turn is indexed by: :attr:`~.model.Turn.implicit`), and that reply.
    implicit: bytes | None
    #: What prefill said of the turn: its prompt tokens (what the next turn's prompt starts
    #: with, unedited), known once prefill answered (a push turn's, after decode started).
    prefilled: PrefillResult
    #: The turn's cache salt (digest): the next turn reuses its KV only under the same.
    salt: bytes | None = None
    #: A named conversation's turn: the digest of its messages (what its forks find it by,
    #: with where its KV stays: :func:`~kvturn.gateway.digests.prompt_key`).
    prompt_digest: bytes | None = None
    reply: dict[str, Any] | None = None
    target_control_url: str | None = None
    #: The decode engine the turn went to.
    decode_url: str = ""
    #: The turn whose request the next one is recognised by (:func:`~.extension.prompt_mark`);
    #: ``None`` where decode-local is off or nothing is kept.
    marks: Turn | None = None
    #: What decode says it retains, when its reply said so (a non-streamed reply carries the
    #: connector's params): no need to ask its control server.
    retained: dict[str, Any] | None = None
    #: The reply did not reach its end (the client left, or decode's stream broke off).
    incomplete: bool = False
    #: Whether the table was told that the reply is under way (:meth:`Settlement.mark_settling`),
    #: and that call, if it is still being made (``None``: made already).
    marked: bool = False
    marking: Awaitable[None] | None = None

    def __post_init__(self) -> None:
        if self.holder is not None:
            self.target_control_url = self.holder.control_url


class Settlement:
    """Counts turns and settles their replies (see the module's docstring)."""

    def __init__(self, context: TurnContext):
        self.context = context
        #: Turns this process served (its share under several workers; /kvturn/status).
        self.turns_served = 0

    def count(self, prefilled: PrefillResult, decode: Instance) -> None:
        """Count a turn once decode has taken it (a retried turn counts once, as it ended)."""
        plan = prefilled.plan
        self.turns_served += 1
        self.context.metrics.turns_by[plan.plan].inc()
        self.context.metrics.plans_by[(plan.plan, plan.reason)].inc()
        if prefilled.uncounted is None:  # else counted after the reply
            self.count_tokens(prefilled)
        moved = 0
        if plan.pulls:
            moved = prefilled.reused_tokens + prefilled.prompt_tokens
        elif not plan.local:
            moved = prefilled.prompt_tokens
        self.context.metrics.kv_bytes_moved_by[plan.plan].inc(moved * decode.kv_bytes_per_token)

    def count_tokens(self, prefilled: PrefillResult) -> None:
        computed = max(0, prefilled.prompt_tokens - prefilled.reused_tokens)
        self.context.metrics.reused_tokens.inc(prefilled.reused_tokens)
        self.context.metrics.recomputed_tokens.inc(computed)
        if prefilled.plan.local:
            self.context.metrics.local_suffix_tokens.inc(computed)

    def learn_first_token(self, prefilled: PrefillResult, decode: Instance, seconds: float) -> None:
        """A streamed turn's first token: what decode added after prefill (or, locally,
        what the holder's own prefill of the suffix took)."""
        if prefilled.instance is None and not prefilled.plan.local:
            return  # a decode alone computed the whole prompt: neither cost
        if prefilled.uncounted is not None:
            prefilled.uncounted.first_token_s = seconds  # learned once the tokens are counted
        elif prefilled.plan.local:
            suffix = max(1, prefilled.prompt_tokens - prefilled.reused_tokens)
            self.context.costs.observe_local(decode.url, suffix, seconds)
        else:
            self.context.costs.observe_handoff(prefilled.prompt_tokens, seconds)

    def mark_settling(self, after: After) -> None:
        """From now until the reply is recorded, the conversation's next turn waits for it
        (a while). Off the response path: :meth:`settle` waits for it before recording.
        For a reply that is under way (a stream), or whose record must first ask decode where
        its KV stays; a reply recorded as soon as it is complete is not marked: a mark would
        reach the table no sooner than the record (one call fewer per turn). A new
        conversation's reply is marked as it ends (:meth:`settle`): nobody can find the
        conversation before it is indexed by that reply, and one call makes its entry,
        indexes it and marks it."""
        taken = after.taken
        if taken is not None:
            after.marked = True
            if not taken.fresh:
                after.marking = self.context.store.settling(taken.conversation.key, taken.turn)

    def settle_later(self, after: After) -> None:
        """Record where the conversation's KV now lives, off the response path."""
        if after.taken is not None:
            self.context.background_task(self.settle(after))

    async def settle(self, after: After) -> None:
        taken, holder, request_id = after.taken, after.holder, after.request_id
        assert taken is not None
        held: Held | None = None
        # An implicit conversation's next turn, or a fork of it, finds it by this turn's
        # messages and reply (a named one's forks, by its messages: :meth:`findable`). The
        # record indexes it by them, in the same step, with where the turn's KV stays: a next
        # turn that comes first finds it by an older turn's (a prefix of its messages too) and
        # waits for the record, if the reply was marked; or it finds the conversation only
        # once its KV is recorded. A new conversation has no older turn: if its record may
        # take a while (a marked reply), it is indexed now, by the call that makes and marks
        # its entry, and again by its record.
        findable = self.findable(after, taken, None)
        try:
            if after.marked and taken.fresh and (holder is not None or findable is not None):
                conversation = taken.conversation
                after.marking = self.context.store.settling(
                    conversation.key, taken.turn, conversation, findable
                )
            if after.marking is not None:
                with contextlib.suppress(StateUnavailable):
                    await after.marking
            retained = after.retained if holder is not None else None
            if retained is None and holder is not None and holder.control_url is not None:
                retained = await self.context.leases.published(
                    holder.control_url, request_id, self.context.config.publish_wait_s
                )
            if retained is not None and holder is not None:
                holder.block_size = int(retained.get(BLOCK_SIZE_KEY) or holder.block_size)
                holder.kv_bytes_per_token = int(
                    retained.get(KV_BYTES_PER_TOKEN_KEY) or holder.kv_bytes_per_token
                )
                # What the next prompt must start with for the holder's cache to serve it: this
                # turn's prompt. (Its reply, re-rendered from text by the chat template, need
                # not come back as the same tokens; the cache still serves what matches.)
                digests = retained.get(PREFIX_DIGESTS_KEY) or []
                # (Decode says how long the prompt was: a push turn or one a decode served
                # alone learns it no other way.)
                prompt_tokens = int(
                    retained.get(PROMPT_TOKENS_KEY) or after.prefilled.prompt_tokens
                )
                # Short of its last few tokens: text appended to a prompt may merge with them
                # into other tokens (ChatML's closing "\n" and a reply's leading space, in
                # SmolLM2's vocabulary), which is no edit of the history.
                verified = max(0, prompt_tokens - BOUNDARY_TOKENS)
                chunks = min(len(digests), verified // DIGEST_CHUNK_TOKENS)
                held = Held(
                    holder.url,
                    request_id,
                    held_tokens=int(retained.get("remote_num_tokens") or 0),
                    lease_expires_in_s=float(retained.get(EXPIRES_IN_KEY) or 0),
                    held_digest=str(digests[chunks - 1]) if chunks else None,
                    held_digest_tokens=chunks * DIGEST_CHUNK_TOKENS,
                    held_salt=after.salt,
                    held_prompt_mark=(
                        prompt_mark(after.marks.body, after.marks.message_digests())
                        if after.marks is not None
                        else None
                    ),
                )
        finally:
            # Always recorded, KV or none: the mark of a reply under way comes off with it. A
            # new conversation's entry is made by its first write (the mark, if there was
            # one), if there is anything to remember: a first turn that failed leaves none.
            findable = self.findable(after, taken, held)
            fresh = taken.fresh and not after.marked and (held is not None or findable is not None)
            await self.record(taken, held, fresh=fresh, findable=findable)
            # After the record: the conversation's next turn may be waiting for it (it
            # recomputes the history if the wait runs out), and nothing here changes it.
            await self.free_left_over(after)
            if after.prefilled.uncounted is not None:
                await self.count_after(after.prefilled, after.decode_url)

    async def free_left_over(self, after: After) -> None:
        """Free what a turn left on decode that nobody will read: an aborted turn's KV, and
        the previous lease a decode-local turn claimed."""
        target, request_id = after.target_control_url, after.request_id
        if target is None:
            return
        # The client left, or the stream broke, before the reply ended: decode keeps what
        # an aborted turn computed (see the connector), and nobody will come back for a
        # reply the client never saw. Free it now, not when its lease lapses.
        wait_s = self.context.config.publish_wait_s
        if after.incomplete and await self.context.leases.published(target, request_id, wait_s):
            await self.context.leases.release(target, request_id)
        if after.supersedes is not None:
            # A decode-local turn's claim on the previous lease ends: its new lease
            # superseded it (freed now that no claim holds it), or, where the turn left
            # nothing behind, it is freed now.
            await self.context.leases.release(target, after.supersedes, claimed=True)

    @staticmethod
    def findable(after: After, taken: Taken, held: Held | None) -> tuple[bytes, Indexed] | None:
        """What the conversation's next turn or a fork of it finds this turn by, and what to
        index under it (with ``held``, where the turn's KV stays): an implicit conversation's
        turn by its messages and reply (that is how its next turn finds it at all); a named
        conversation's by its messages alone, once its KV is known (only forks look)."""
        conversation = taken.conversation
        indexed = Indexed(conversation.key, conversation.conversation_id, taken.turn)
        if held is not None and held.held_digest is not None:
            indexed = Indexed(
                conversation.key,
                conversation.conversation_id,
                taken.turn,
                held.holder_url,
                held.held_digest,
                held.held_digest_tokens,
            )
        if after.implicit is not None and after.reply is not None:
            return extend(after.implicit, after.reply), indexed
        if after.prompt_digest is not None and indexed.digest is not None:
            return prompt_key(after.prompt_digest), indexed
        return None

    async def count_after(self, prefilled: PrefillResult, decode_url: str) -> None:
        """Count an uncounted turn's prompt now that its reply is over: for the metrics and
        the learned costs, and to check the bound it was planned by (see
        :mod:`kvturn.gateway.extension`). A bound that did not hold ends planning by bounds in
        this gateway."""
        uncounted = prefilled.uncounted
        assert uncounted is not None
        decode = self.context.decode.get(decode_url)
        if decode is None:
            return
        url = counter(self.context.prefill, decode).url
        ids = await prompt_token_ids(self.context.upstream, url, uncounted.path, uncounted.body)
        if ids is None:
            return
        prefilled.prompt_tokens = len(ids)
        self.count_tokens(prefilled)
        suffix = max(1, len(ids) - uncounted.covered)
        covered = last_prefix_digest(ids, uncounted.covered, DIGEST_CHUNK_TOKENS)
        matches = covered == uncounted.digest
        if uncounted.first_token_s is not None:
            self.context.costs.observe_local(decode_url, suffix, uncounted.first_token_s)
        if (not matches or suffix > uncounted.bound) and self.context.bound_extensions:
            self.context.bound_extensions = False
            self.context.metrics.bound_violations.inc()
            logger.warning(
                "a decode-local turn planned from a bound on its new tokens computed more "
                "(%d tokens past the verified prefix, bound %d, prefix %s): this model's chat "
                "template does not render a longer conversation as an extension of the "
                "shorter; counting every reuse turn's tokens from now on",
                suffix,
                uncounted.bound,
                "verified" if matches else "changed",
            )

    async def record(
        self,
        taken: Taken,
        held: Held | None,
        *,
        fresh: bool = False,
        findable: tuple[bytes, Indexed] | None = None,
    ) -> None:
        """Record ``held`` as the conversation's KV (``fresh``: making its entry; and
        ``findable``, indexing it by its messages); free whatever nobody can come back for:
        this turn's KV if a newer turn recorded first, or the conversation was released (or
        the table is unreachable), and the older KV this record replaces."""
        conversation = taken.conversation
        try:
            recorded = await self.context.store.record(
                conversation.key,
                conversation.epoch,
                taken.turn,
                held,
                fresh=conversation if fresh else None,
                findable=findable,
            )
        except StateUnavailable:
            recorded = Recorded(held is None)
        if held is not None and not recorded.kept:
            self.context.release_url_later(held.holder_url, held.request_id)
        if recorded.replaced is not None:
            self.context.release_url_later(*recorded.replaced)
