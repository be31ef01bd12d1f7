"""Reuse, the planner-facing step of a turn: which conversation it continues (by its id, or
found by its messages: :mod:`kvturn.gateway.state.implicit`), what the table gives it, and how it
uses the conversation's previous KV: ``decode-local`` on the holder, ``pull-reuse`` (prefill
reads it), each claiming the lease until it ends, or ``recompute`` (the old lease freed). The
arithmetic of the choice is :mod:`kvturn.gateway.planner`'s; this step gathers its inputs (the
prompt's tokens, asked of an engine, or a bound on them: :mod:`kvturn.gateway.extension`)."""

from __future__ import annotations

import os
import time
from typing import Any

from kvturn.gateway.auth import scoped_key
from kvturn.gateway.errors import NoHealthyEngine, StateUnavailable
from kvturn.gateway.extension import new_tokens_bound
from kvturn.gateway.planner import (
    ReuseInputs,
    TurnPlan,
    choose_reuse,
    plan_turn,
)
from kvturn.gateway.pools import Instance
from kvturn.gateway.state.implicit import Indexed
from kvturn.gateway.state.table import Conversation, Taken, fresh_turn
from kvturn.gateway.tokens import prompt_token_ids
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.model import Reuse, Turn, Uncounted
from kvturn.gateway.turns.placement import choose_prefill, counter
from kvturn.gateway.turns.sharing import Sharing, indexed_digest, reply_ends
from kvturn.wire import DIGEST_CHUNK_TOKENS, EXPIRES_IN_KEY, last_prefix_digest

#: Why the holder had no lease to claim → the turn's fallback reason.
GONE_REASONS = {
    "expired": "lease-expired",
    "reclaimed": "lease-reclaimed",
    "holder-unreachable": "holder-unhealthy",
}


class ReuseStep:
    """Finds, takes and plans a turn's conversation (see the module's docstring)."""

    def __init__(self, context: TurnContext):
        self.context = context
        self.sharing = Sharing(context)

    async def take(self, turn: Turn) -> Taken | None:
        """The conversation the turn continues (by its id, or found by its messages), taken
        off the table for this turn: its previous KV is this turn's alone. ``None``: no
        conversation (or the table could not be reached: the turn is marked for it). A turn
        with nothing of its own to reuse may find a :class:`~.model.Source` to share
        (:mod:`.sharing`)."""
        taken: Taken | None = None
        shared_prefixes = self.context.config.shared_prefixes
        try:
            found: Indexed | None = None
            if turn.conversation_id:
                key, conversation_id = (
                    scoped_key(turn.tenant, turn.conversation_id),
                    turn.conversation_id,
                )
                if shared_prefixes:
                    turn.prompt_digest = indexed_digest(turn)  # forks of it find it
            elif self.context.config.implicit_conversations and indexed_digest(turn):
                turn.implicit = indexed_digest(turn)  # its next turn finds it
                found = await self.implicit_conversation(turn)
                if found is None:
                    key, conversation_id = self.new_implicit(turn, "new")
                else:
                    key, conversation_id = found.key, found.conversation_id
            else:
                return None
            if turn.implicit is not None and found is None and self.context.store.reachable:
                taken = fresh_turn(key, conversation_id)  # nothing to take
            else:
                # The previous turn's KV location may still be being recorded: wait briefly.
                # An implicit turn takes the conversation only if it extends its newest turn.
                after_turn = found.turn if found is not None and shared_prefixes else None
                taken = await self.context.store.take(
                    key, conversation_id, turn.turn_id, self.context.config.publish_wait_s,
                    after_turn=after_turn or None,
                )  # fmt: skip
                if found is not None and taken.moved_on:
                    # A fork of an older turn: a conversation of its own, sharing the KV.
                    turn.source = self.sharing.source_of(turn, found, taken.conversation)
                    taken = fresh_turn(*self.new_implicit(turn, "forked"))
                elif found is not None:
                    self.context.metrics.implicit_by["matched"].inc()
            if turn.source is None:
                await self.sharing.find_source(turn, taken.conversation)
        except StateUnavailable:
            # Nothing is known, nothing will be recorded: the turn recomputes and its decode
            # keeps no KV (no conversation to lease it to).
            turn.state_unavailable = True
            turn.implicit = turn.prompt_digest = None
            turn.source = None
        else:
            if taken is not None and taken.retry:
                self.context.metrics.turn_retries.inc()
            elif taken is not None and not turn.heartbeats and self.context.returns.enabled:
                self.observe_return(turn, taken)
        return taken

    def observe_return(self, turn: Turn, taken: Taken) -> None:
        """A conversation whose client sends no heartbeats came back: the gap since its last
        turn recorded its KV teaches its tenant's lease length (:mod:`kvturn.gateway.returns`).
        Only a gap after a recorded turn counts (not a parallel turn's, not a fork's)."""
        previous = taken.conversation
        if taken.fresh or taken.moved_on or previous.holder_url is None or previous.heartbeats:
            return
        if previous.last_seen > 0:
            gap = self.context.store.clock() - previous.last_seen
            self.context.returns.observe(turn.tenant, gap)

    async def implicit_conversation(self, turn: Turn) -> Indexed | None:
        """The recorded turn a chat request without an id extends, found by its messages
        (see :mod:`kvturn.gateway.state.implicit`). Its conversation is the request's, if that
        turn is the conversation's newest; a request that extends an older turn of a
        conversation that has moved on is a fork (:meth:`take`): a new conversation, sharing
        the old one's KV (:mod:`.sharing`), never taking it."""
        # Only a prefix that ends with a reply can be a recorded turn's messages plus reply: a
        # conversation's first request (no assistant message yet) is not looked up at all.
        ends = reply_ends(turn)
        return await self.context.store.implicit.match(ends) if ends else None

    def new_implicit(self, turn: Turn, why: str) -> tuple[str, str]:
        """A new implicit conversation's key and id, just drawn (``why``: a new history, or a
        fork; counted)."""
        self.context.metrics.implicit_by[why].inc()
        conversation_id = f"implicit-{os.urandom(12).hex()}"
        return scoped_key(turn.tenant, conversation_id), conversation_id

    async def plan(self, turn: Turn, conversation: Conversation | None) -> Reuse:
        """Decide how this turn uses the conversation's previous KV; claim it if prefill
        will read it. A turn with none, but a :class:`~.model.Source`, may share that."""
        own = conversation is not None and conversation.holder_url is not None
        if turn.source is not None and not own and not turn.state_unavailable:
            shared = await self.sharing.plan(turn, turn.source, conversation)
            if shared is not None:
                return shared
        holder = self.context.decode.get(conversation.holder_url) if conversation else None
        plan = plan_turn(
            conversation,
            self.context.store.clock(),
            holder_healthy=holder is not None and holder.healthy and holder.control_url is not None,
            expiry_margin_s=self.context.config.expiry_margin_s,
            threshold_tokens=self.context.config.reuse_threshold_tokens,
            salt=turn.salt,
        )
        if turn.state_unavailable:
            plan = TurnPlan("recompute", "state-unavailable")
        if conversation is None or conversation.holder_url is None:
            self.context.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)
        # The table gave this turn alone the KV (decode frees retained blocks after one read:
        # a parallel turn of the same conversation found nothing to take; see .sharing).
        key = conversation.holder_request_id
        digest_tokens = conversation.held_digest_tokens
        if holder is None or holder.control_url is None or not key:
            self.context.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)
        if not plan.pulls:
            # This turn recomputes: the old lease can never be read again.
            if holder.draining:
                self.context.metrics.drain_handoffs_by["lost"].inc()
            self.context.release_later(holder, key)
            self.context.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)

        plan, prompt_tokens, uncounted = await self.choose(turn, holder, conversation)
        if plan.pulls and self.context.config.transfer == "push":
            # Push mode has no pull (see kvturn.connector.push). Where a pull would have been
            # cheaper than a local prefill, a local one is still far cheaper than recomputing
            # the history; otherwise prefill recomputes and pushes to the holder (preferred as
            # decode), whose prefix cache covers the history: only the suffix is written. The
            # old lease keeps the history cached until the new turn is recorded.
            if plan.reason != "cheaper":
                plan = TurnPlan("recompute", plan.reason)
                self.context.metrics.fallbacks_by[plan.reason].inc()
                return Reuse(plan)
            plan = TurnPlan("decode-local", "no-pull-in-push")
        # Held for this turn, a pull's or a local prefill's, until it ends: memory pressure on
        # the holder reclaims it no more. A lease already gone is found now, not by the holder
        # computing the lost history beside the streams it decodes (a local turn), or by a
        # pull reading nothing.
        outcome = await self.context.leases.claim(holder.control_url, key)
        if outcome.params is None or not (plan.local or self.usable(outcome.params)):
            plan = TurnPlan("recompute", GONE_REASONS.get(outcome.reason, "kv-gone"))
            if holder.draining:
                self.context.metrics.drain_handoffs_by["lost"].inc()
            if outcome.params is not None:
                self.context.release_later(holder, key, claimed=True)
            self.context.metrics.fallbacks_by[plan.reason].inc()
            unreachable = outcome.reason == "holder-unreachable"
            return Reuse(plan, avoid=holder if unreachable else None)
        if plan.local:
            # The holder's prefix cache serves whole blocks of the verified prefix; the last
            # prompt token is always computed. The turn's new lease supersedes the claimed one.
            covered = digest_tokens if uncounted else min(digest_tokens, max(0, prompt_tokens - 1))
            if holder.block_size:
                covered -= covered % holder.block_size
            return Reuse(
                plan,
                holder=holder,
                previous_key=key,
                prompt_tokens=prompt_tokens,
                reused_tokens=covered,
                uncounted=uncounted,
            )
        params = outcome.params
        params["remote_host"] = holder.host
        return Reuse(plan, params, claimed=(holder, key))

    async def choose(
        self, turn: Turn, holder: Instance, conversation: Conversation
    ) -> tuple[TurnPlan, int, Uncounted | None]:
        """``decode-local`` or ``pull-reuse``, from the prompt's exact token ids (asked of
        an engine only when a local turn is possible at all), or, for a request that extends
        the held one, from a bound on its new tokens when that bound already says
        ``decode-local`` (:mod:`kvturn.gateway.extension`); and the prompt's length (0: not
        counted)."""
        limits = self.context.limits
        if holder.draining:
            # It takes no new turns; prefill reads the history from it while it answers.
            return TurnPlan("pull-reuse", "holder-draining"), 0, None
        if not limits.enabled:
            return TurnPlan("pull-reuse", "local-off"), 0, None
        if holder.in_flight >= limits.max_running:
            # choose_reuse would say the same; known now, it saves asking for the token ids.
            return TurnPlan("pull-reuse", "holder-busy"), 0, None
        held = conversation.held_tokens
        digest = conversation.held_digest
        digest_tokens = conversation.held_digest_tokens
        try:
            prefill_url = choose_prefill(self.context.prefill, turn).url
        except NoHealthyEngine:
            prefill_url = ""
        bound = None
        if self.context.bound_extensions and digest is not None:
            bound = new_tokens_bound(
                turn.body, turn.message_digests(), conversation.held_prompt_mark
            )
        if bound is not None:
            # What the holder computes: the held tokens past the verified prefix (the
            # previous prompt's tail and its reply), then what the new messages render to.
            suffix = max(0, held - digest_tokens) + bound
            inputs = ReuseInputs(
                held_tokens=held,
                prompt_tokens=digest_tokens + suffix,
                prefix_matches=True,
                covered_tokens=digest_tokens,
                holder_running=holder.in_flight,
                holder_url=holder.url,
                prefill_url=prefill_url,
            )
            plan = choose_reuse(inputs, limits, self.context.costs)
            if plan.local:
                self.context.metrics.uncounted_turns.inc()
                uncounted = Uncounted(turn.path, turn.body, suffix, digest_tokens, digest)
                return plan, 0, uncounted
        started = time.perf_counter()
        ids = await prompt_token_ids(
            self.context.upstream, counter(self.context.prefill, holder).url, turn.path, turn.body
        )
        matches = None
        if ids is not None and digest is not None:
            matches = last_prefix_digest(ids, digest_tokens, DIGEST_CHUNK_TOKENS) == digest
        self.context.metrics.count_seconds.observe(time.perf_counter() - started)
        inputs = ReuseInputs(
            held_tokens=held,
            prompt_tokens=None if ids is None else len(ids),
            prefix_matches=matches,
            covered_tokens=digest_tokens,
            holder_running=holder.in_flight,
            holder_url=holder.url,
            prefill_url=prefill_url,
        )
        return (
            choose_reuse(inputs, limits, self.context.costs),
            0 if ids is None else len(ids),
            None,
        )

    def usable(self, params: dict[str, Any]) -> bool:
        """Whether a claimed lease still runs long enough for the pull to land."""
        return float(params.pop(EXPIRES_IN_KEY, 0)) > self.context.config.expiry_margin_s
