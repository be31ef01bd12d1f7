"""One turn through prefill and decode: plan, pull or recompute, stream back, remember.
(With ``transfer="push"``: prefill and decode at once, prefill writing into decode's blocks.)

This module only shapes requests, carries ``kv_transfer_params`` between the engines and
updates the conversation table. Routing lives in :mod:`.pools`, the decision in
:mod:`.planner`, HTTP framing in :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvturn import headers as h
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.batches import batched_prompts, serve_batch
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.conversations import (
    Conversation,
    ConversationTable,
    Held,
    Recorded,
    Taken,
    fresh_turn,
    salt_digest,
)
from kvturn.gateway.errors import GatewayError, NoHealthyEngine, UpstreamError
from kvturn.gateway.extension import BOUNDARY_TOKENS, new_tokens_bound, prompt_mark
from kvturn.gateway.http.upstream import (
    StreamResponse,
    Upstream,
    UpstreamResponse,
    UpstreamUnavailable,
    next_chunk,
)
from kvturn.gateway.implicit import (
    Index,
    ReplyCollector,
    extend,
    message_digests,
    reply_message,
    seed,
)
from kvturn.gateway.leases import LeaseClient
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.planner import (
    CostModel,
    LocalLimits,
    ReuseInputs,
    TurnPlan,
    choose_reuse,
    plan_turn,
)
from kvturn.gateway.pools import Instance, Pool
from kvturn.gateway.replies import Reply
from kvturn.gateway.response_store import StateUnavailable
from kvturn.gateway.tokens import CHAT_PATH, prompt_token_ids
from kvturn.kv_params import (
    BLOCK_SIZE_KEY,
    DIGEST_CHUNK_TOKENS,
    KV_BYTES_PER_TOKEN_KEY,
    PREFILL_FOR_REMOTE_DECODE,
    PREFIX_DIGESTS_KEY,
    PROMPT_TOKENS_KEY,
    last_prefix_digest,
)

logger = logging.getLogger("kvturn.gateway")

#: ``kv_transfer_params`` keys decode's kvturn connector reads (see ``kvturn.connector.nixl``).
CONVERSATION_PARAM = "kvturn_conversation"
#: A decode-local turn's request reaches the holder's engine core within this long of being
#: sent (its API server renders and tokenizes it first): the engine steps often meanwhile.
LOCAL_ARRIVAL_MS = 50
#: A decode engine paced while idle (on CPU) keeps its idle steps 10 ms apart for its first
#: 2 s of idleness and a quarter second apart after (``IdlePacer`` in
#: ``kvturn.connector.engine_pacing``). A wake at a turn's start is worth sending only to end
#: such a long wait: one this gateway sent a request or a wake within this long is still in
#: its short phase (half of it: a margin), and a turn's decode request, sent after prefill,
#: would sit out a short wait with or without a wake.
WAKE_AFTER_IDLE_S = 1.0
#: How many requests more than the least loaded prefill a turn's affine prefill may be serving
#: and still get it (:meth:`TurnRunner._choose_prefill`): a prefix-cache hit saves most of a
#: prefill, a queue of two is a fraction of one.
PREFILL_AFFINITY_SLACK = 2
LEASE_PARAM = "kvturn_lease_s"
PAUSE_PARAM = "kvturn_pause"
#: Why the holder had no lease to claim → the turn's fallback reason.
_GONE_REASONS = {
    "expired": "lease-expired",
    "reclaimed": "lease-reclaimed",
    "holder-unreachable": "holder-unhealthy",
}

#: What prefill gets when nothing is reused: compute, and keep the KV for decode to pull.
RECOMPUTE_PARAMS = PREFILL_FOR_REMOTE_DECODE
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
    #: The caller's tenant (``""`` on an open gateway): conversations are its own.
    tenant: str = ""
    #: For a turn of an implicit conversation: the digest of its messages, which its reply
    #: extends into the key the next turn is found by.
    implicit: bytes | None = None
    #: The conversation table could not be reached: the turn recomputes, keeping nothing.
    state_unavailable: bool = False
    #: A chat turn's chained message digests (see :meth:`message_digests`).
    digests: list[bytes] | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def message_digests(self) -> list[bytes]:
        """Digest ``i`` commits to the tenant, model, cache salt and messages ``0..i``
        (:func:`~.implicit.message_digests`); computed once. Empty for a request without
        chat messages."""
        if self.digests is None:
            messages = self.body.get("messages")
            if self.path != CHAT_PATH or not isinstance(messages, list):
                self.digests = []
            else:
                start = seed(self.tenant, self.body.get("model"), self.body.get("cache_salt"))
                self.digests = message_digests(start, messages)
        return self.digests


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


@dataclass(slots=True)
class Uncounted:
    """A ``decode-local`` turn planned from a bound on its new tokens (:mod:`.extension`),
    not from counting them: the count comes after the reply, off the response path, and
    checks the bound."""

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


class TurnRunner:
    """Serve turns through the prefill and decode pools."""

    def __init__(
        self,
        config: GatewayConfig,
        prefill: Pool,
        decode: Pool,
        upstream: Upstream,
        store: ConversationTable,
        metrics: GatewayMetrics,
    ):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.leases = LeaseClient(upstream, config.control_secret)
        self.costs = CostModel()
        self.limits = LocalLimits(
            enabled=config.decode_local,
            max_suffix_tokens=config.max_local_suffix_tokens,
            max_running=config.max_local_running,
            stall_weight=config.local_stall_weight,
            preference=config.local_preference,
        )
        self.implicit: Index = store.implicit
        self._background: set[asyncio.Task[None]] = set()
        #: Turns this process served (its share under several workers; /kvturn/status).
        self.turns_served = 0
        #: Plan a turn that extends the held one from a bound on its new tokens (see
        #: :mod:`.extension`); off for good once a bound did not hold.
        self.bound_extensions = True

    async def run(self, turn: Turn) -> Reply:
        prompts = batched_prompts(turn.path, turn.body)
        if prompts is not None:
            # vLLM answers a batch with one kv_transfer_params (the first prompt's): each
            # prompt needs a prefill/decode pair of its own. A batch is never a conversation.
            subturns = [
                Turn(turn.path, {**turn.body, "prompt": prompt}, None, turn.turn_id, turn.started)
                for prompt in prompts
            ]
            return await serve_batch(
                [self._serve(sub, None) for sub in subturns],
                stream=turn.stream,
                choices_per_prompt=int(turn.body.get("n") or 1),
            )
        taken: Taken | None = None
        try:
            named: tuple[str, str, bool] | None = None
            if turn.conversation_id:
                key = scoped_key(turn.tenant, turn.conversation_id)
                named = key, turn.conversation_id, False
            elif self.config.implicit_conversations:
                named = await self._implicit_conversation(turn)
            if named is not None:
                key, conversation_id, new = named
                if new and self.store.reachable:
                    taken = fresh_turn(key, conversation_id)  # nothing to take
                else:
                    # The previous turn's KV location may still be being recorded: wait
                    # briefly.
                    wait_s = self.config.publish_wait_s
                    taken = await self.store.take(key, conversation_id, turn.turn_id, wait_s)
        except StateUnavailable:
            # Nothing is known, nothing will be recorded: the turn recomputes and its decode
            # keeps no KV (no conversation to lease it to).
            turn.state_unavailable = True
            turn.implicit = None
        else:
            if taken is not None and taken.retry:
                self.metrics.turn_retries.inc()
        return await self._serve(turn, taken)

    async def _implicit_conversation(self, turn: Turn) -> tuple[str, str, bool] | None:
        """The conversation (key, id) a chat request without an id continues, found by its
        messages (see :mod:`.implicit`), or a new one that its next turn can find (and
        whether it is new: a key just drawn, in no table yet)."""
        messages = turn.body.get("messages")
        if turn.path != CHAT_PATH or not isinstance(messages, list) or not messages:
            return None
        if (turn.body.get("n") or 1) != 1:
            return None  # which choice comes back next turn is not known
        digests = turn.message_digests()
        turn.implicit = digests[-1]
        # Only a prefix that ends with a reply can be a recorded turn's messages plus reply: a
        # conversation's first request (no assistant message yet) is not looked up at all.
        ends = [d for d, m in zip(digests, messages, strict=True) if _is_reply(m)]
        found = await self.implicit.match(ends) if ends else None
        if found is not None:
            key, conversation_id = found
            self.metrics.implicit_by["matched"].inc()
            return key, conversation_id, False
        conversation_id = f"implicit-{os.urandom(12).hex()}"
        self.metrics.implicit_by["new"].inc()
        return scoped_key(turn.tenant, conversation_id), conversation_id, True

    async def _serve(self, turn: Turn, taken: Taken | None) -> Reply:
        """Plan; then the holder decode alone, or prefill then decode; once more from
        scratch if decode fails before replying. Where one side has no engine left that
        answers, the other side's engine serves the turn alone."""
        conversation = taken.conversation if taken is not None else None
        self._wake_decode(conversation)
        reuse = await self._plan(turn, conversation)
        failed: Instance | None = None
        if reuse.plan.local:
            assert reuse.holder is not None
            if reuse.holder.control_url is not None:
                # Sent now: the engine steps often until the request is there.
                wake = self.leases.wake(reuse.holder.control_url, within_ms=LOCAL_ARRIVAL_MS)
                self._background_task(wake)
            local = PrefillResult(
                None,
                {},
                reuse.prompt_tokens,
                reuse.reused_tokens,
                reuse.plan,
                uncounted=reuse.uncounted,
            )
            try:
                return await self._decode(
                    turn, taken, local, target=reuse.holder, supersedes=reuse.previous_key
                )
            except DecodeFailed as failure:
                failed = self._decode_failed(failure)
                if reuse.previous_key is not None:
                    self._release_later(reuse.holder, reuse.previous_key)
                reuse = self._decode_failed_reuse()
        if self.config.transfer == "push":
            return await self._serve_push(turn, taken, reuse.plan, failed)
        for _ in range(2):
            if not self.decode.healthy():
                return await self._prefill_alone(turn, taken, "no-decode")
            try:
                prefilled = await self._prefill(turn, reuse)
            except NoHealthyEngine:
                return await self._decode_alone(turn, taken, "no-prefill", failed)
            except UpstreamError:
                return await self._decode_alone(turn, taken, "prefill-failed", failed)
            if isinstance(prefilled, Reply):
                return prefilled
            try:
                return await self._decode(turn, taken, prefilled, avoid=failed)
            except DecodeFailed as failure:
                # Decode died, or failed its pull from prefill, before replying: serve the turn
                # again from scratch, on another decode if there is one.
                failed = self._decode_failed(failure)
                reuse = self._decode_failed_reuse()
            except NoHealthyEngine:
                return await self._prefill_alone(turn, taken, "no-decode")
        return await self._prefill_alone(turn, taken, "decode-failed-twice")

    def _decode_failed(self, failure: DecodeFailed) -> Instance | None:
        """Note a decode that failed before replying; the instance, to avoid on a retry."""
        logger.warning("decode failed before replying (%s); recomputing", failure)
        self.metrics.upstream_errors_by["decode"].inc()
        failed = self.decode.get(failure.url)
        if failed is not None and failure.unreachable:
            failed.healthy = False
        return failed

    def _decode_failed_reuse(self) -> Reuse:
        plan = TurnPlan("recompute", "decode-failed")
        self.metrics.fallbacks_by[plan.reason].inc()
        return Reuse(plan)

    # ---- push ------------------------------------------------------------------------------

    async def _serve_push(
        self, turn: Turn, taken: Taken | None, plan: TurnPlan, failed: Instance | None
    ) -> Reply:
        """Push P/D (``transfer="push"``): decode registers its blocks with prefill while
        prefill computes, and prefill WRITEs the KV into them, so prefill and decode are sent
        the turn at once, under one request id (how upstream's push pairs the two requests).
        Decode is chosen at dispatch, as it cannot wait for prefill's answer: the least
        loaded, the conversation's holder on a tie. If prefill fails, decode's request is
        aborted and the turn is served by a decode alone; if decode fails before replying,
        the turn is pushed once more, to another decode if there is one."""
        for _ in range(2):
            try:
                return await self._push_turn(turn, taken, plan, avoid=failed)
            except DecodeFailed as failure:
                failed = self._decode_failed(failure)
                plan = self._decode_failed_reuse().plan
        return await self._prefill_alone(turn, taken, "decode-failed-twice")

    async def _push_turn(
        self, turn: Turn, taken: Taken | None, plan: TurnPlan, avoid: Instance | None
    ) -> Reply:
        try:
            prefill = self._choose_prefill(turn)
        except NoHealthyEngine:
            return await self._decode_alone(turn, taken, "no-prefill", avoid)
        assert prefill.control_url is not None  # GatewayConfig checks it for push
        identity = prefill.identity
        if identity is None:
            identity = prefill.identity = await self.leases.identity(prefill.control_url)
        if identity is None:
            logger.warning("prefill %s: no NIXL identity from its control server", prefill.url)
            prefill.healthy = False
            return await self._decode_alone(turn, taken, "prefill-unreachable", avoid)
        request_id = f"kvturn-{os.urandom(16).hex()}"
        pushed = PrefillResult(
            prefill,
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": identity["engine_id"],
                "remote_host": prefill.host,
                "remote_port": int(identity["side_channel_port"]),
                "tp_size": int(identity.get("tp_size") or 1),
                "pp_size": int(identity.get("pp_size") or 1),
                "remote_block_ids": None,
                # Prefill's own id for the request carries a suffix vLLM draws at random;
                # decode uses this one only to name the request in heartbeats to prefill
                # (prefill matches decode's registration by the id both were sent).
                "remote_request_id": request_id,
            },
            prompt_tokens=0,
            reused_tokens=0,
            plan=plan,
        )
        conversation = taken.conversation if taken is not None else None
        try:
            decode = self.decode.choose(
                prefer=conversation.holder_url if conversation else None, exclude=avoid
            )
        except NoHealthyEngine:
            try:
                decode = self.decode.choose()
            except NoHealthyEngine:
                return await self._prefill_alone(turn, taken, "no-decode")
        prefilling = asyncio.ensure_future(self._push_prefill(turn, prefill, request_id, pushed))
        decoding = asyncio.ensure_future(
            self._decode(turn, taken, pushed, target=decode, request_id=request_id)
        )
        watching: asyncio.Future[bool | None] | None = None
        try:
            await asyncio.wait({prefilling, decoding}, return_when=asyncio.FIRST_COMPLETED)
            if decoding.done() and (
                decoding.exception() is not None or decoding.result().status != 200
            ):
                # Decode failed before replying (pushed again), or refused the request (its
                # answer is the client's): prefill's work would be written nowhere.
                prefilling.cancel()
                await asyncio.gather(prefilling, return_exceptions=True)
                return decoding.result()
            if not await prefilling:
                # Prefill failed: its KV will never be written. Abort decode's request (its
                # blocks return once its registration times out, see kvturn.connector.push).
                prefill.identity = None  # a restarted engine has a new one
                await _cancel_reply(decoding)
                return await self._decode_alone(turn, taken, "prefill-failed", avoid)
            # Prefill computed the prompt and writes it now. Nothing tells decode if that
            # write fails (or prefill dies first): it would wait for good. Ask it.
            watching = asyncio.ensure_future(self._push_arrives(decode, request_id))
            await asyncio.wait({watching, decoding}, return_when=asyncio.FIRST_COMPLETED)
            if decoding.done() and (decoding.exception() is not None or not _streamed(decoding)):
                return decoding.result()  # a whole reply, or decode failed: pushed again
            arrived = await watching
            if arrived is None and not await self.upstream.is_healthy(decode.url):
                # Decode died while it waited (its stream has sent nothing yet): push again.
                await _cancel_reply(decoding)
                raise DecodeFailed(decode.url, unreachable=True)
            if arrived is False:
                logger.warning(
                    "decode %s never got the KV prefill pushed; serving alone", decode.url
                )
                await _cancel_reply(decoding)
                return await self._decode_alone(turn, taken, "push-lost", avoid)
            return await decoding
        except BaseException:
            prefilling.cancel()
            if watching is not None:
                watching.cancel()
            await _cancel_reply(decoding)
            raise
        finally:
            if watching is not None and not watching.done():
                watching.cancel()

    async def _push_arrives(self, decode: Instance, request_id: str) -> bool | None:
        """Whether the KV prefill pushed reaches ``decode``: False once decode has awaited it
        for ``push_write_timeout_s`` (time it spends queued, not yet scheduled, is not
        counted: it registers, and prefill writes, when it is); None if decode cannot say."""
        if decode.control_url is None:
            return None
        loop = asyncio.get_running_loop()
        timeout_s = self.config.push_write_timeout_s
        deadline = loop.time() + timeout_s
        # Bounded like any engine request: a decode that never schedules it cannot be judged.
        give_up = loop.time() + self.config.request_timeout_s
        while loop.time() < give_up:
            wait_s = max(0.0, min(deadline - loop.time(), 5.0))
            state = await self.leases.push_state(decode.control_url, request_id, wait_s)
            if state is None:
                return None
            if state == "arrived":
                return True
            if state == "awaiting" and loop.time() >= deadline:
                return False
            if state != "awaiting":
                deadline = loop.time() + timeout_s
                await asyncio.sleep(0.05)
        return None

    async def _push_prefill(
        self, turn: Turn, prefill: Instance, request_id: str, pushed: PrefillResult
    ) -> bool:
        """Prefill's half of a push turn; whether it computed the prompt (and so writes it)."""
        body = _prefill_body(turn.body, RECOMPUTE_PARAMS)
        prefill.in_flight += 1
        started = time.perf_counter()
        try:
            response = await self.upstream.post_json(
                prefill.url + turn.path, body, {"X-Request-Id": request_id}
            )
        except UpstreamUnavailable:
            prefill.healthy = False
            response = None
        finally:
            prefill.in_flight -= 1
        if response is None or response.status != 200:
            logger.warning("push prefill failed (%s); serving on decode alone", _status(response))
            self.metrics.upstream_errors_by["prefill"].inc()
            return False
        pushed.finished_at = time.perf_counter()
        self.metrics.prefill_seconds_by[pushed.plan.plan].observe(pushed.finished_at - started)
        usage = response.json().get("usage") or {}
        pushed.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        seconds = pushed.finished_at - started
        self.costs.observe_prefill(prefill.url, pushed.prompt_tokens, 0, seconds)
        return True

    async def _decode_alone(
        self, turn: Turn, taken: Taken | None, reason: str, avoid: Instance | None
    ) -> Reply:
        """The turn on a decode engine by itself (no prefill could serve it), which computes
        the whole prompt, or what its prefix cache lacks (the holder is preferred); its KV is
        kept for the next turn as after a decode-local turn. No decode either: the 503."""
        plan = TurnPlan("recompute", reason)
        self.metrics.fallbacks_by[reason].inc()
        alone = PrefillResult(None, {}, 0, 0, plan)
        try:
            return await self._decode(turn, taken, alone, avoid=avoid)
        except DecodeFailed as failure:
            avoid = self._decode_failed(failure)
        try:
            return await self._decode(turn, taken, alone, avoid=avoid)
        except DecodeFailed as failure:
            self._decode_failed(failure)
            raise UpstreamError(f"prefill and decode failed ({failure})") from None

    async def _prefill_alone(self, turn: Turn, taken: Taken | None, reason: str) -> Reply:
        """No decode can take the turn (none is healthy, or decode failed twice): a prefill
        engine, a whole vLLM engine too, serves it alone, as one engine would. Prefill engines
        hold no conversation's KV, so nothing is kept for the next turn (it recomputes, on a
        decode again once one is back). No prefill either: the 503 stands."""
        plan = TurnPlan("recompute", reason)
        self.metrics.fallbacks_by[reason].inc()
        logger.warning("no decode engine can serve the turn (%s); prefill serves it alone", reason)
        instance = self.prefill.choose()
        alone = PrefillResult(None, {}, 0, 0, plan)
        try:
            return await self._decode(turn, taken, alone, target=instance, keep=False)
        except DecodeFailed as failure:
            self.metrics.upstream_errors_by["prefill"].inc()
            if failure.unreachable:
                instance.healthy = False
            raise UpstreamError(f"no decode engine, and prefill failed too ({failure})") from None

    def _wake_decode(self, conversation: Conversation | None) -> None:
        """An idle decode paces its empty steps (up to a quarter second apart while it holds
        leases): tell the one this turn will likely use, while prefill runs, unless it was
        busy lately (see ``WAKE_AFTER_IDLE_S``)."""
        try:
            target = self.decode.choose(prefer=conversation.holder_url if conversation else None)
        except NoHealthyEngine:
            return
        now = time.monotonic()
        if (
            target.in_flight == 0
            and target.control_url is not None
            and now - target.last_sent >= WAKE_AFTER_IDLE_S
        ):
            target.last_sent = now
            self._background_task(self.leases.wake(target.control_url))

    async def close(self, grace_s: float = 2.0) -> None:
        """Let background work (recording where replies left their KV, freeing leases) finish
        for up to ``grace_s``: with a shared table, the next turn may come to another replica
        or to this gateway's successor. Then cancel what is left."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=grace_s)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ---- prefill ----------------------------------------------------------------------------

    async def _plan(self, turn: Turn, conversation: Conversation | None) -> Reuse:
        """Decide how this turn uses the conversation's previous KV; claim it if prefill
        will read it."""
        holder = self.decode.get(conversation.holder_url) if conversation else None
        plan = plan_turn(
            conversation,
            self.store.clock(),
            holder_healthy=holder is not None and holder.healthy and holder.control_url is not None,
            expiry_margin_s=self.config.expiry_margin_s,
            threshold_tokens=self.config.reuse_threshold_tokens,
            salt=salt_digest(turn.body.get("cache_salt")),
        )
        if turn.state_unavailable:
            plan = TurnPlan("recompute", "state-unavailable")
        if conversation is None or conversation.holder_url is None:
            self.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)
        # The table gave this turn alone the KV (decode frees retained blocks after one read:
        # a parallel turn of the same conversation found nothing and recomputes).
        key = conversation.holder_request_id
        digest_tokens = conversation.held_digest_tokens
        if holder is None or holder.control_url is None or not key:
            self.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)
        if not plan.pulls:
            # This turn recomputes: the old lease can never be read again.
            self._release_later(holder, key)
            self.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)

        plan, prompt_tokens, uncounted = await self._choose(turn, holder, conversation)
        if plan.pulls and self.config.transfer == "push":
            # Push mode has no pull (see kvturn.connector.push). Where a pull would have been
            # cheaper than a local prefill, a local one is still far cheaper than recomputing
            # the history; otherwise prefill recomputes and pushes to the holder (preferred as
            # decode), whose prefix cache covers the history: only the suffix is written. The
            # old lease keeps the history cached until the new turn is recorded.
            if plan.reason != "cheaper":
                plan = TurnPlan("recompute", plan.reason)
                self.metrics.fallbacks_by[plan.reason].inc()
                return Reuse(plan)
            plan = TurnPlan("decode-local", "no-pull-in-push")
        if plan.local:
            # The holder's prefix cache serves whole blocks of the verified prefix; the last
            # prompt token is always computed.
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
        outcome = await self.leases.claim(holder.control_url, key)
        if outcome.params is None or not self._usable(outcome.params):
            plan = TurnPlan("recompute", _GONE_REASONS.get(outcome.reason, "kv-gone"))
            if outcome.params is not None:
                self._release_later(holder, key, claimed=True)
            self.metrics.fallbacks_by[plan.reason].inc()
            return Reuse(plan)
        params = outcome.params
        params["remote_host"] = holder.host
        return Reuse(plan, params, claimed=(holder, key))

    async def _choose(
        self, turn: Turn, holder: Instance, conversation: Conversation
    ) -> tuple[TurnPlan, int, Uncounted | None]:
        """``decode-local`` or ``pull-reuse``, from the prompt's exact token ids (asked of
        an engine only when a local turn is possible at all), or, for a request that extends
        the held one, from a bound on its new tokens when that bound already says
        ``decode-local`` (:mod:`.extension`); and the prompt's length (0: not counted)."""
        limits = self.limits
        if not limits.enabled:
            return TurnPlan("pull-reuse", "local-off"), 0, None
        if holder.in_flight >= limits.max_running:
            # choose_reuse would say the same; known now, it saves asking for the token ids.
            return TurnPlan("pull-reuse", "holder-busy"), 0, None
        held = conversation.held_tokens
        digest = conversation.held_digest
        digest_tokens = conversation.held_digest_tokens
        try:
            prefill_url = self._choose_prefill(turn).url
        except NoHealthyEngine:
            prefill_url = ""
        bound = None
        if self.bound_extensions and digest is not None:
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
            plan = choose_reuse(inputs, limits, self.costs)
            if plan.local:
                self.metrics.uncounted_turns.inc()
                uncounted = Uncounted(turn.path, turn.body, suffix, digest_tokens, digest)
                return plan, 0, uncounted
        started = time.perf_counter()
        ids = await prompt_token_ids(self.upstream, self._counter(holder).url, turn.path, turn.body)
        matches = None
        if ids is not None and digest is not None:
            matches = last_prefix_digest(ids, digest_tokens, DIGEST_CHUNK_TOKENS) == digest
        self.metrics.count_seconds.observe(time.perf_counter() - started)
        inputs = ReuseInputs(
            held_tokens=held,
            prompt_tokens=None if ids is None else len(ids),
            prefix_matches=matches,
            covered_tokens=digest_tokens,
            holder_running=holder.in_flight,
            holder_url=holder.url,
            prefill_url=prefill_url,
        )
        return choose_reuse(inputs, limits, self.costs), 0 if ids is None else len(ids), None

    def _choose_prefill(self, turn: Turn, exclude: Instance | None = None) -> Instance:
        """The prefill for a turn: the one its conversation's prompts have gone to (so its
        prefix cache may still hold them), unless that one serves more than
        :data:`PREFILL_AFFINITY_SLACK` requests more than the least loaded.

        A chat turn is placed by the digest of its first two messages (the system prompt and
        the first user message, with the tenant, model and cache salt): stable for every turn
        of a conversation, shared by a fork or subagent that starts from the same messages,
        and spread across conversations that share only a system prompt (each prefill then
        computes that prompt once). Other requests by their conversation id, if any."""
        key: bytes | None = None
        if len(self.prefill.instances) > 1:
            digests = turn.message_digests()
            if digests:
                key = digests[min(1, len(digests) - 1)]
            elif turn.conversation_id:
                key = f"{turn.tenant}\0{turn.conversation_id}".encode()
        prefer = self.prefill.affine(key) if key is not None else None
        return self.prefill.choose(prefer, exclude=exclude, slack=PREFILL_AFFINITY_SLACK)

    def _counter(self, holder: Instance) -> Instance:
        """Where to count a prompt's tokens: an idle prefill engine if there is one (every
        engine renders the same template with the same tokenizer), else the holder. The holder
        is being woken for this very turn (see :meth:`_wake_decode`), and on CPU engines its API
        server shares a core with that engine: measured here, ``/tokenize`` of a 2k-token chat
        prompt took 2.8 ms on an idle prefill engine and 4.1 ms on an idle decode."""
        idle = [i for i in self.prefill.healthy() if i.in_flight == 0]
        return idle[0] if idle else holder

    async def _prefill(self, turn: Turn, reuse: Reuse) -> PrefillResult | Reply:
        plan = reuse.plan
        params = reuse.params
        claimed = reuse.claimed
        body = _prefill_body(turn.body, params)
        attempts = 0
        tried: Instance | None = None
        response: UpstreamResponse | None = None
        while True:
            attempts += 1
            try:
                instance = self._choose_prefill(turn, exclude=tried)
            except NoHealthyEngine:
                if tried is None:
                    raise
                raise UpstreamError(f"prefill failed ({_status(response)})") from None
            instance.in_flight += 1
            started = time.perf_counter()
            try:
                response = await self.upstream.post_json(instance.url + turn.path, body)
            except UpstreamUnavailable:
                instance.healthy = False
                response = None
            finally:
                instance.in_flight -= 1
            if response is not None and response.status == 200:
                break
            if response is not None and 400 <= response.status < 500 and params is RECOMPUTE_PARAMS:
                return _passthrough(response.status, response.body)
            self.metrics.upstream_errors_by["prefill"].inc()
            if params is not RECOMPUTE_PARAMS:
                # vLLM answers a declined or failed pull with an error: retry as plain recompute.
                logger.warning("prefill with reuse failed (%s); recomputing", _status(response))
                if claimed is not None and response is not None:
                    # Prefill answered: its read is over, whatever became of it.
                    self._release_later(*claimed, claimed=True)
                claimed = None
                params, plan = RECOMPUTE_PARAMS, TurnPlan("recompute", "pull-failed")
                self.metrics.fallbacks_by[plan.reason].inc()
                body = _prefill_body(turn.body, params)
                continue  # same or another instance: a failed pull says nothing about its health
            if attempts >= 3 or not self.prefill.healthy():
                if response is None:
                    raise NoHealthyEngine("no prefill engine answered")
                raise UpstreamError(f"prefill failed with HTTP {response.status}")
            tried = instance

        finished = time.perf_counter()
        self.metrics.prefill_seconds_by[plan.plan].observe(finished - started)
        data = response.json()
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # Cached tokens are prefill's own prefix-cache hits, plus what it pulled if it pulled:
        # a turn that did not pull computed only the rest, and says nothing of a pull's cost.
        pulled = reused if plan.pulls else 0
        self.costs.observe_prefill(instance.url, prompt_tokens - reused, pulled, finished - started)
        if plan.pulls and reused == 0:
            plan = TurnPlan("recompute", "no-common-prefix")
            self.metrics.fallbacks_by[plan.reason].inc()
            if claimed is not None:
                # Nothing was read (the prompt shares no verified prefix): free it now.
                self._release_later(*claimed, claimed=True)
        decode_params = dict(data.get("kv_transfer_params") or {})
        if not decode_params:
            raise UpstreamError("prefill returned no kv_transfer_params (is it a kvturn engine?)")
        decode_params["remote_host"] = instance.host
        return PrefillResult(instance, decode_params, prompt_tokens, reused, plan, finished)

    def _usable(self, params: dict[str, Any]) -> bool:
        """Whether a claimed lease still runs long enough for the pull to land."""
        return float(params.pop("expires_in_s", 0)) > self.config.expiry_margin_s

    def _release_later(self, holder: Instance, key: str, *, claimed: bool = False) -> None:
        """Free a lease nobody will read, off the response path."""
        if holder.control_url is None:
            return
        self._background_task(self.leases.release(holder.control_url, key, claimed=claimed))

    def _background_task(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- decode -----------------------------------------------------------------------------

    async def _decode(
        self,
        turn: Turn,
        taken: Taken | None,
        prefilled: PrefillResult,
        *,
        target: Instance | None = None,
        supersedes: str | None = None,
        avoid: Instance | None = None,
        request_id: str | None = None,
        keep: bool = True,
    ) -> Reply:
        """Decode's reply: after prefill (on a decode other than ``avoid``, if there is one),
        or (``target``, a ``decode-local`` turn) on the holder alone, whose new lease then
        ``supersedes`` the previous one. ``keep=False``: the engine keeps no KV of the turn
        (a prefill engine serving it alone)."""
        conversation = taken.conversation if taken is not None else None
        prefer = conversation.holder_url if conversation else None
        if target is not None:
            instance = target
        else:
            try:
                instance = self.decode.choose(prefer=prefer, exclude=avoid)
            except NoHealthyEngine:
                instance = self.decode.choose(prefer=prefer)
        # 128 random bits: the reply's id is made of it (no turn counter shows through), and
        # decode publishes the KV it retains under it. (A push turn's prefill shares it.)
        request_id = request_id or f"kvturn-{os.urandom(16).hex()}"
        body = dict(turn.body)
        params = dict(prefilled.params)
        # What decode's connector needs to lease the KV this turn leaves (or to free it at
        # once: a turn without a conversation never comes back for it).
        params[CONVERSATION_PARAM] = conversation.key if conversation and keep else None
        # The lease this decode grants (its connector cuts a longer one): the client plans its
        # heartbeats from what the header says, so it must never say more.
        lease_s = instance.lease_s(self.config.lease_s)
        params[LEASE_PARAM] = lease_s
        if turn.pause is not None:
            params[PAUSE_PARAM] = list(turn.pause)
        body["kv_transfer_params"] = params
        plan = prefilled.plan
        response_headers = {
            h.PLAN: plan.plan,
            h.PLAN_REASON: plan.reason,
            h.REUSED_TOKENS: str(prefilled.reused_tokens),
        }
        if conversation is not None:
            response_headers[h.CONVERSATION_ID] = conversation.conversation_id
            response_headers[h.LEASE_SECONDS] = f"{lease_s:g}"
        url = instance.url + turn.path
        upstream_headers = {"X-Request-Id": request_id}
        after = _After(
            taken,
            instance if keep else None,
            request_id,
            supersedes,
            turn.implicit,
            prefilled,
            salt_digest(turn.body.get("cache_salt")),
            decode_url=instance.url,
            # Marked after the reply, off the response path, if anything is retained.
            marks=turn if keep and self.limits.enabled else None,
        )

        instance.last_sent = time.monotonic()
        if not turn.stream:
            instance.in_flight += 1
            try:
                response = await self.upstream.post_json(url, body, upstream_headers)
            except UpstreamUnavailable as error:
                raise DecodeFailed(instance.url, unreachable=True) from error
            except asyncio.CancelledError:
                # The client left: the engine request was closed (vLLM aborts it). Free what
                # decode may keep of it, as for a stream the client left.
                after.holder, after.incomplete = None, True
                prefilled.uncounted = None  # nor counted: the turn never answered
                self._settle_later(after)
                raise
            finally:
                instance.in_flight -= 1
            if response.status >= 500:
                raise DecodeFailed(instance.url, unreachable=False)
            if response.status != 200:
                after.holder, prefilled.uncounted = None, None  # no turn to count
                self._settle_later(after)
                return _passthrough(response.status, response.body, response_headers)
            payload = response.body
            data = response.json()
            if plan.local:
                # The holder says how much its prefix cache served.
                cached = (data.get("usage") or {}).get("prompt_tokens_details") or {}
                if "cached_tokens" in cached:
                    prefilled.reused_tokens = int(cached["cached_tokens"] or 0)
                    response_headers[h.REUSED_TOKENS] = str(prefilled.reused_tokens)
            self._count(prefilled, instance)
            after.retained = _retained_in(data.get("kv_transfer_params"))
            if after.retained is None and after.holder is not None:
                # Decode did not say where the KV stays: the record waits on asking it.
                self._mark_settling(after)
            if data.get("kv_transfer_params") is not None:
                # Engine-internal: shown to callers as one engine alone shows it (null).
                data["kv_transfer_params"] = None
                payload = orjson.dumps(data)
            if turn.implicit is not None:
                after.reply = reply_message(data)
            self._settle_later(after)
            return Reply(200, payload, response_headers)

        instance.in_flight += 1
        sent = time.perf_counter()
        try:
            upstream = await self.upstream.open_stream(url, body, upstream_headers)
        except UpstreamUnavailable as error:
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=True) from error
        if upstream.status >= 500:
            await upstream.aclose()
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=False)
        self._mark_settling(after)
        if upstream.status != 200:
            try:
                payload = await upstream.read()
            except Exception:
                payload = b""
            await upstream.aclose()
            instance.in_flight -= 1
            after.holder, prefilled.uncounted = None, None  # no turn to count
            self._settle_later(after)
            return _passthrough(upstream.status, payload, response_headers)
        relay = _Relay(self, upstream, instance, prefilled, after, turn.started, sent)
        return Reply(200, headers=response_headers, stream=relay)

    def _count(self, prefilled: PrefillResult, decode: Instance) -> None:
        """Count a turn once decode has taken it (a retried turn counts once, as it ended)."""
        plan = prefilled.plan
        self.turns_served += 1
        self.metrics.turns_by[plan.plan].inc()
        self.metrics.plans_by[(plan.plan, plan.reason)].inc()
        if prefilled.uncounted is None:  # else counted after the reply
            self._count_tokens(prefilled)
        moved = 0
        if plan.pulls:
            moved = prefilled.reused_tokens + prefilled.prompt_tokens
        elif not plan.local:
            moved = prefilled.prompt_tokens
        self.metrics.kv_bytes_moved_by[plan.plan].inc(moved * decode.kv_bytes_per_token)

    def _count_tokens(self, prefilled: PrefillResult) -> None:
        self.metrics.reused_tokens.inc(prefilled.reused_tokens)
        self.metrics.recomputed_tokens.inc(
            max(0, prefilled.prompt_tokens - prefilled.reused_tokens)
        )

    def _learn_first_token(
        self, prefilled: PrefillResult, decode: Instance, seconds: float
    ) -> None:
        """A streamed turn's first token: what decode added after prefill (or, locally,
        what the holder's own prefill of the suffix took)."""
        if prefilled.instance is None and not prefilled.plan.local:
            return  # a decode alone computed the whole prompt: neither cost
        if prefilled.uncounted is not None:
            prefilled.uncounted.first_token_s = seconds  # learned once the tokens are counted
        elif prefilled.plan.local:
            suffix = max(1, prefilled.prompt_tokens - prefilled.reused_tokens)
            self.costs.observe_local(decode.url, suffix, seconds)
        else:
            self.costs.observe_handoff(prefilled.prompt_tokens, seconds)

    # ---- after the reply --------------------------------------------------------------------

    def _mark_settling(self, after: _After) -> None:
        """From now until the reply is recorded, the conversation's next turn waits for it
        (a while). Off the response path: :meth:`_settle` waits for it before recording.
        For a reply that is under way (a stream), or whose record must first ask decode where
        its KV stays; a reply recorded as soon as it is complete is not marked: a mark would
        reach the table no sooner than the record (one call fewer per turn). A new
        conversation's reply is marked as it ends (:meth:`_settle`): nobody can find the
        conversation before it is indexed by that reply, and one call makes its entry,
        indexes it and marks it."""
        taken = after.taken
        if taken is not None:
            after.marked = True
            if not taken.fresh:
                after.marking = self.store.settling(taken.conversation.key, taken.turn)

    def _settle_later(self, after: _After) -> None:
        """Record where the conversation's KV now lives, off the response path."""
        if after.taken is not None:
            self._background_task(self._settle(after))

    async def _settle(self, after: _After) -> None:
        taken, holder, request_id = after.taken, after.holder, after.request_id
        assert taken is not None
        held: Held | None = None
        # An implicit conversation's next turn finds it by this turn's messages and reply.
        # The record indexes it by them, in the same step: a next turn that comes first
        # finds it by an older turn's (a prefix of its messages too) and waits for the
        # record, if the reply was marked; or it finds the conversation only once its KV is
        # recorded. A new conversation has no older turn: if its record may take a while (a
        # marked reply), it is indexed now, by the call that makes and marks its entry.
        findable = self._findable(after, taken.conversation)
        try:
            if after.marked and taken.fresh and (holder is not None or findable is not None):
                conversation = taken.conversation
                after.marking = self.store.settling(
                    conversation.key, taken.turn, conversation, findable
                )
                findable = None
            if after.marking is not None:
                with contextlib.suppress(StateUnavailable):
                    await after.marking
            retained = after.retained if holder is not None else None
            if retained is None and holder is not None and holder.control_url is not None:
                retained = await self.leases.published(
                    holder.control_url, request_id, self.config.publish_wait_s
                )
            target = after.target_control_url
            # The client left, or the stream broke, before the reply ended: decode keeps what
            # an aborted turn computed (see the connector), and nobody will come back for a
            # reply the client never saw. Free it now, not when its lease lapses.
            wait_s = self.config.publish_wait_s
            if (
                after.incomplete
                and target is not None
                and await self.leases.published(target, request_id, wait_s)
            ):
                await self.leases.release(target, request_id)
            if after.supersedes is not None and retained is None and target is not None:
                # A decode-local turn that left nothing behind: its new lease would have
                # superseded the previous one; free that now instead.
                await self.leases.release(target, after.supersedes)
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
                    lease_expires_in_s=float(retained.get("expires_in_s") or 0),
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
            fresh = taken.fresh and not after.marked and (held is not None or findable is not None)
            await self._record(taken, held, fresh=fresh, findable=findable)
            if after.prefilled.uncounted is not None:
                await self._count_after(after.prefilled, after.decode_url)

    @staticmethod
    def _findable(
        after: _After, conversation: Conversation
    ) -> tuple[bytes, tuple[str, str]] | None:
        """An implicit conversation's next turn starts with this turn's messages and reply:
        the digest of them, and the conversation to index under it."""
        if after.implicit is None or after.reply is None:
            return None
        digest = extend(after.implicit, after.reply)
        return digest, (conversation.key, conversation.conversation_id)

    async def _count_after(self, prefilled: PrefillResult, decode_url: str) -> None:
        """Count an uncounted turn's prompt now that its reply is over: for the metrics and
        the learned costs, and to check the bound it was planned by (see :mod:`.extension`).
        A bound that did not hold ends planning by bounds in this gateway."""
        uncounted = prefilled.uncounted
        assert uncounted is not None
        decode = self.decode.get(decode_url)
        if decode is None:
            return
        url = self._counter(decode).url
        ids = await prompt_token_ids(self.upstream, url, uncounted.path, uncounted.body)
        if ids is None:
            return
        prefilled.prompt_tokens = len(ids)
        self._count_tokens(prefilled)
        suffix = max(1, len(ids) - uncounted.covered)
        covered = last_prefix_digest(ids, uncounted.covered, DIGEST_CHUNK_TOKENS)
        matches = covered == uncounted.digest
        if uncounted.first_token_s is not None:
            self.costs.observe_local(decode_url, suffix, uncounted.first_token_s)
        if (not matches or suffix > uncounted.bound) and self.bound_extensions:
            self.bound_extensions = False
            self.metrics.bound_violations.inc()
            logger.warning(
                "a decode-local turn planned from a bound on its new tokens computed more "
                "(%d tokens past the verified prefix, bound %d, prefix %s): this model's chat "
                "template does not render a longer conversation as an extension of the "
                "shorter; counting every reuse turn's tokens from now on",
                suffix,
                uncounted.bound,
                "verified" if matches else "changed",
            )

    async def _record(
        self,
        taken: Taken,
        held: Held | None,
        *,
        fresh: bool = False,
        findable: tuple[bytes, tuple[str, str]] | None = None,
    ) -> None:
        """Record ``held`` as the conversation's KV (``fresh``: making its entry; and
        ``findable``, indexing it by its messages); free whatever nobody can come back for:
        this turn's KV if a newer turn recorded first, or the conversation was released (or
        the table is unreachable), and the older KV this record replaces."""
        conversation = taken.conversation
        try:
            recorded = await self.store.record(
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
            self._release_url_later(held.holder_url, held.request_id)
        if recorded.replaced is not None:
            self._release_url_later(*recorded.replaced)

    def _release_url_later(self, holder_url: str, request_id: str) -> None:
        holder = self.decode.get(holder_url)
        if holder is not None:
            self._release_later(holder, request_id)


@dataclass(slots=True)
class _After:
    """What the gateway records once a turn's reply is over."""

    taken: Taken | None
    #: The decode that served the turn and may retain its KV (``None``: it retains nothing).
    holder: Instance | None
    request_id: str
    #: ``decode-local``: the lease the new one supersedes on the same decode.
    supersedes: str | None
    #: Implicit conversations: the digest of the turn's messages, and the reply that extends it.
    implicit: bytes | None
    #: What prefill said of the turn: its prompt tokens (what the next turn's prompt starts
    #: with, unedited), known once prefill answered (a push turn's, after decode started).
    prefilled: PrefillResult
    #: The turn's cache salt (digest): the next turn reuses its KV only under the same.
    salt: bytes | None = None
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
    #: Whether the table was told that the reply is under way (:meth:`TurnRunner._mark_settling`),
    #: and that call, if it is still being made (``None``: made already).
    marked: bool = False
    marking: Awaitable[None] | None = None

    def __post_init__(self) -> None:
        if self.holder is not None:
            self.target_control_url = self.holder.control_url


#: The event a streamed reply ends with when decode's stream breaks off mid-way.
_STREAM_BROKE = (
    b"data: "
    + orjson.dumps(
        UpstreamError("the decode engine's stream broke off before the reply was complete").body()
    )
    + b"\n\n"
)


class _Relay:
    """Decode's streamed reply on its way to the client (a :class:`~.replies.ReplyStream`):
    observes TTFT at the first chunk; when the stream ends or is closed, frees the instance
    and records where the conversation's KV now lives (nowhere, if the stream broke off)."""

    def __init__(
        self,
        runner: TurnRunner,
        upstream: StreamResponse,
        instance: Instance,
        prefilled: PrefillResult,
        after: _After,
        started: float,
        sent: float,
    ):
        self.runner = runner
        self.upstream = upstream
        self.prefilled = prefilled
        self.after = after
        self.instance = instance
        self.started = started
        self.sent = sent
        self.collector = ReplyCollector() if after.implicit is not None else None
        self.first = True
        self.closed = False
        self.broken = False
        #: Decode's ``[DONE]`` was relayed: the reply is whole, whatever comes after.
        self.done = False

    @property
    def at_end(self) -> bool:
        return self.upstream.at_end

    async def next_chunk(self) -> bytes | None:
        if self.broken:
            return None
        try:
            chunk = await next_chunk(self.upstream)
        except UpstreamUnavailable as error:
            # Too late to retry the turn: tell the client the OpenAI way (the SDK raises an
            # APIError for an error event) rather than cutting the connection.
            logger.warning("decode's stream broke off: %s", error)
            self.runner.metrics.upstream_errors_by["decode"].inc()
            self.broken = True
            return _STREAM_BROKE
        if chunk is not None:
            if chunk.endswith(_SSE_DONE):
                # The client has the whole reply once this is relayed, and may close at once.
                self.done = True
            if self.first:
                self.first = False
                now = time.perf_counter()
                runner, prefilled = self.runner, self.prefilled
                runner.metrics.ttft_by[prefilled.plan.plan].observe(now - self.started)
                runner._count(prefilled, self.instance)
                since = prefilled.finished_at if prefilled.instance is not None else self.sent
                runner._learn_first_token(prefilled, self.instance, now - since)
            if self.collector is not None:
                self.collector.feed(chunk)
        return chunk

    async def abandon(self) -> None:
        """Close it unsent: the turn is served another way, and counted there."""
        self.first = False
        self.broken = True
        await self.aclose()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        completed = (self.upstream.at_end or self.done) and not self.broken
        await self.upstream.aclose()
        self.instance.in_flight -= 1
        if self.first:
            # Closed before any chunk: decode took the turn all the same.
            self.runner._count(self.prefilled, self.instance)
        if not completed:
            self.after.holder = None
            self.after.incomplete = True
        elif self.collector is not None:
            self.after.reply = self.collector.message()
        self.runner._settle_later(self.after)


_SSE_DONE = b"data: [DONE]\n\n"


def _retained_in(params: Any) -> dict[str, Any] | None:
    """The lease a decode's non-streamed reply describes (the kvturn connector's params), if
    it describes one."""
    if isinstance(params, dict) and "expires_in_s" in params and PREFIX_DIGESTS_KEY in params:
        return params
    return None


def _is_reply(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    prefill = {k: v for k, v in body.items() if k not in _DECODE_ONLY_FIELDS}
    if body.get("temperature") == 0 and "n" in body:
        # Greedy sampling refuses n > 1: let prefill's own validation say so before any work.
        prefill["n"] = body["n"]
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = dict(params)
    return prefill


def _passthrough(status: int, payload: bytes, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, payload, headers or {})


def _status(response: Any) -> str:
    return "unreachable" if response is None else f"HTTP {response.status}"


async def _cancel_reply(decoding: asyncio.Future[Reply]) -> None:
    """Call off a decode request whose reply the client will never see (its turn is served
    another way, or not at all): vLLM aborts a request whose connection closes."""
    decoding.cancel()
    await asyncio.gather(decoding, return_exceptions=True)
    if not decoding.cancelled() and decoding.exception() is None:
        reply = decoding.result()
        if isinstance(reply.stream, _Relay):
            await reply.stream.abandon()


def _streamed(decoding: asyncio.Future[Reply]) -> bool:
    return decoding.result().stream is not None


class DecodeFailed(Exception):
    """Decode failed before sending a byte of its reply: the turn can still be retried."""

    def __init__(self, url: str, *, unreachable: bool):
        super().__init__(f"{url} {'unreachable' if unreachable else 'answered 5xx'}")
        self.url = url
        self.unreachable = unreachable


__all__ = ["RECOMPUTE_PARAMS", "GatewayError", "Turn", "TurnRunner"]
