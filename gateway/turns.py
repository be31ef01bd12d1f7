"""One turn through prefill and decode: plan, pull or recompute, stream back, remember.

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
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvturn import headers as h
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.batches import batched_prompts, serve_batch
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.conversations import Conversation, ConversationStore
from kvturn.gateway.errors import GatewayError, NoHealthyEngine, UpstreamError
from kvturn.gateway.leases import LeaseClient
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.planner import TurnPlan, plan_turn
from kvturn.gateway.pools import Instance, Pool
from kvturn.gateway.replies import Reply
from kvturn.gateway.upstream import (
    StreamResponse,
    Upstream,
    UpstreamResponse,
    UpstreamUnavailable,
    next_chunk,
)
from kvturn.kv_params import PREFILL_FOR_REMOTE_DECODE

logger = logging.getLogger("kvturn.gateway")

#: ``kv_transfer_params`` keys decode's kvturn connector reads (see ``kvturn.connector.nixl``).
CONVERSATION_PARAM = "kvturn_conversation"
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

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(slots=True)
class PrefillResult:
    instance: Instance
    params: dict[str, Any]
    prompt_tokens: int
    reused_tokens: int
    plan: TurnPlan


class TurnRunner:
    """Serve turns through the prefill and decode pools."""

    def __init__(
        self,
        config: GatewayConfig,
        prefill: Pool,
        decode: Pool,
        upstream: Upstream,
        store: ConversationStore,
        metrics: GatewayMetrics,
    ):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.leases = LeaseClient(upstream, config.control_secret)
        self._background: set[asyncio.Task[None]] = set()

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
        conversation = (
            self.store.get_or_create(
                scoped_key(turn.tenant, turn.conversation_id), turn.conversation_id
            )
            if turn.conversation_id
            else None
        )
        if conversation is not None and self.store.note_turn(conversation, turn.turn_id):
            self.metrics.turn_retries.inc()
        if conversation is not None and conversation.settling is not None:
            # The previous turn's KV location is still being recorded: wait briefly for it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conversation.settling.wait(), self.config.publish_wait_s)
        return await self._serve(turn, conversation)

    async def _serve(self, turn: Turn, conversation: Conversation | None) -> Reply:
        """Prefill then decode, once more from scratch if decode fails before replying."""
        self._wake_decode(conversation)
        prefilled = await self._prefill(turn, conversation)
        if isinstance(prefilled, Reply):
            return prefilled
        try:
            return await self._decode(turn, conversation, prefilled)
        except DecodeFailed as failure:
            # Decode died, or failed its pull from prefill, before replying: serve the turn
            # again from scratch (on another decode if this one is gone).
            logger.warning("decode failed before replying (%s); recomputing", failure)
            self.metrics.upstream_errors_by["decode"].inc()
            failed = self.decode.get(failure.url)
            if failed is not None and failure.unreachable:
                failed.healthy = False
            retry = await self._prefill(turn, None, forced=TurnPlan("recompute", "decode-failed"))
            if isinstance(retry, Reply):
                return retry
            return await self._decode(turn, conversation, retry)

    def _wake_decode(self, conversation: Conversation | None) -> None:
        """An idle decode paces its empty steps (up to a quarter second apart while it holds
        leases): tell the one this turn will likely use, while prefill runs."""
        try:
            target = self.decode.choose(prefer=conversation.holder_url if conversation else None)
        except NoHealthyEngine:
            return
        if target.in_flight == 0 and target.control_url is not None:
            self._background_task(self.leases.wake(target.control_url))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ---- prefill ----------------------------------------------------------------------------

    async def _prefill(
        self, turn: Turn, conversation: Conversation | None, forced: TurnPlan | None = None
    ) -> PrefillResult | Reply:
        plan = forced or self._plan(conversation)
        params = RECOMPUTE_PARAMS
        # The lease this turn holds on its conversation's previous KV, if any: (holder, key).
        claimed: tuple[Instance, str] | None = None
        if conversation is not None and conversation.holder_url is not None:
            # Decode frees retained blocks after one read: take them off the table for this
            # turn before any await, so a parallel turn of the same conversation recomputes
            # instead of reading blocks that may already hold something else.
            holder = self.decode.get(conversation.holder_url)
            key = conversation.holder_request_id
            self.store.forget_kv(conversation)
            if holder is not None and holder.control_url is not None and key:
                if plan.reuses:
                    outcome = await self.leases.claim(holder.control_url, key)
                    if outcome.params is None or not self._usable(outcome.params):
                        plan = TurnPlan("recompute", _GONE_REASONS.get(outcome.reason, "kv-gone"))
                        if outcome.params is not None:
                            self._release_later(holder, key, claimed=True)
                    else:
                        params = outcome.params
                        params["remote_host"] = holder.host
                        claimed = (holder, key)
                else:
                    # This turn recomputes: the old lease can never be read again.
                    self._release_later(holder, key)
        if not plan.reuses:
            self.metrics.fallbacks_by[plan.reason].inc()

        body = _prefill_body(turn.body, params)
        attempts = 0
        tried: Instance | None = None
        response: UpstreamResponse | None = None
        while True:
            attempts += 1
            try:
                instance = self.prefill.choose(exclude=tried)
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

        self.metrics.prefill_seconds_by[plan.plan].observe(time.perf_counter() - started)
        data = response.json()
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if plan.reuses and reused == 0:
            plan = TurnPlan("recompute", "no-common-prefix")
            self.metrics.fallbacks_by[plan.reason].inc()
            if claimed is not None:
                # Nothing was read (the prompt shares no verified prefix): free it now.
                self._release_later(*claimed, claimed=True)
        decode_params = dict(data.get("kv_transfer_params") or {})
        if not decode_params:
            raise UpstreamError("prefill returned no kv_transfer_params (is it a kvturn engine?)")
        decode_params["remote_host"] = instance.host
        return PrefillResult(instance, decode_params, prompt_tokens, reused, plan)

    def _plan(self, conversation: Conversation | None) -> TurnPlan:
        holder = self.decode.get(conversation.holder_url) if conversation else None
        return plan_turn(
            conversation,
            self.store.clock(),
            holder_healthy=holder is not None and holder.healthy and holder.control_url is not None,
            expiry_margin_s=self.config.expiry_margin_s,
            threshold_tokens=self.config.reuse_threshold_tokens,
        )

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
        self, turn: Turn, conversation: Conversation | None, prefilled: PrefillResult
    ) -> Reply:
        instance = self.decode.choose(prefer=conversation.holder_url if conversation else None)
        # 128 random bits: the reply's id is made of it (no turn counter shows through), and
        # decode publishes the KV it retains under it.
        request_id = f"kvturn-{os.urandom(16).hex()}"
        body = dict(turn.body)
        params = dict(prefilled.params)
        # What decode's connector needs to lease the KV this turn leaves (or to free it at
        # once: a turn without a conversation never comes back for it).
        params[CONVERSATION_PARAM] = conversation.key if conversation else None
        params[LEASE_PARAM] = self.config.lease_s
        if turn.pause is not None:
            params[PAUSE_PARAM] = list(turn.pause)
        body["kv_transfer_params"] = params
        plan = prefilled.plan
        response_headers = {
            h.PLAN: plan.plan,
            h.REUSED_TOKENS: str(prefilled.reused_tokens),
        }
        if conversation is not None:
            conversation.turns += 1
            response_headers[h.CONVERSATION_ID] = conversation.conversation_id
            response_headers[h.LEASE_SECONDS] = f"{self.config.lease_s:g}"
        url = instance.url + turn.path
        upstream_headers = {"X-Request-Id": request_id}

        if not turn.stream:
            instance.in_flight += 1
            try:
                response = await self.upstream.post_json(url, body, upstream_headers)
            except UpstreamUnavailable as error:
                raise DecodeFailed(instance.url, unreachable=True) from error
            finally:
                instance.in_flight -= 1
            if response.status >= 500:
                raise DecodeFailed(instance.url, unreachable=False)
            _mark_settling(conversation)
            if response.status != 200:
                self._settle_later(conversation, None, request_id)
                return _passthrough(response.status, response.body, response_headers)
            self._count(prefilled)
            payload = response.body
            if b'"kv_transfer_params"' in payload and b'"kv_transfer_params":null' not in payload:
                # Engine-internal: shown to callers as one engine alone shows it (null).
                data = response.json()
                data["kv_transfer_params"] = None
                payload = orjson.dumps(data)
            self._settle_later(conversation, instance, request_id)
            return Reply(200, payload, response_headers)

        instance.in_flight += 1
        try:
            upstream = await self.upstream.open_stream(url, body, upstream_headers)
        except UpstreamUnavailable as error:
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=True) from error
        if upstream.status >= 500:
            await upstream.aclose()
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=False)
        _mark_settling(conversation)
        if upstream.status != 200:
            try:
                payload = await upstream.read()
            except Exception:
                payload = b""
            await upstream.aclose()
            instance.in_flight -= 1
            self._settle_later(conversation, None, request_id)
            return _passthrough(upstream.status, payload, response_headers)
        self._count(prefilled)

        relay = _Relay(self, upstream, instance, conversation, request_id, plan.plan, turn.started)
        return Reply(200, headers=response_headers, stream=relay)

    def _count(self, prefilled: PrefillResult) -> None:
        """Count a turn once decode has taken it (a retried turn counts once, as it ended)."""
        self.metrics.turns_by[prefilled.plan.plan].inc()
        self.metrics.reused_tokens.inc(prefilled.reused_tokens)
        self.metrics.recomputed_tokens.inc(
            max(0, prefilled.prompt_tokens - prefilled.reused_tokens)
        )

    # ---- after the reply --------------------------------------------------------------------

    def _settle_later(
        self, conversation: Conversation | None, holder: Instance | None, request_id: str
    ) -> None:
        """Record where the conversation's KV now lives, off the response path."""
        if conversation is None:
            return
        self._background_task(self._settle(conversation, holder, request_id))

    async def _settle(
        self, conversation: Conversation, holder: Instance | None, request_id: str
    ) -> None:
        event = conversation.settling
        try:
            retained = None
            if holder is not None and holder.control_url is not None:
                retained = await self.leases.published(
                    holder.control_url, request_id, self.config.publish_wait_s
                )
            if retained is None or holder is None:
                self.store.forget_kv(conversation)
            elif self.store.peek(conversation.key) is not conversation:
                # Released (or forgotten) while this turn ran: nobody will come back for it.
                assert holder.control_url is not None
                await self.leases.release(holder.control_url, request_id)
            else:
                self.store.record_retained(
                    conversation,
                    holder.url,
                    request_id,
                    held_tokens=int(retained.get("remote_num_tokens") or 0),
                    lease_expires_in_s=float(retained.get("expires_in_s") or 0),
                )
        finally:
            if event is not None:
                event.set()
            if conversation.settling is event:
                conversation.settling = None


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
        conversation: Conversation | None,
        request_id: str,
        plan: str,
        started: float,
    ):
        self.runner = runner
        self.upstream = upstream
        self.instance = instance
        self.conversation = conversation
        self.request_id = request_id
        self.plan = plan
        self.started = started
        self.first = True
        self.closed = False
        self.broken = False

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
        if chunk is not None and self.first:
            self.first = False
            self.runner.metrics.ttft_by[self.plan].observe(time.perf_counter() - self.started)
        return chunk

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        completed = self.upstream.at_end
        await self.upstream.aclose()
        self.instance.in_flight -= 1
        self.runner._settle_later(
            self.conversation, self.instance if completed else None, self.request_id
        )


def _mark_settling(conversation: Conversation | None) -> None:
    """From now until the reply is recorded, the conversation's next turn waits for it."""
    if conversation is not None:
        conversation.settling = asyncio.Event()


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


class DecodeFailed(Exception):
    """Decode failed before sending a byte of its reply: the turn can still be retried."""

    def __init__(self, url: str, *, unreachable: bool):
        super().__init__(f"{url} {'unreachable' if unreachable else 'answered 5xx'}")
        self.url = url
        self.unreachable = unreachable


__all__ = ["RECOMPUTE_PARAMS", "GatewayError", "Turn", "TurnRunner"]
