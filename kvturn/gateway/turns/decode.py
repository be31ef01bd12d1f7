"""Decode's part of a turn: its request (the params its connector leases the turn's KV by), and
its reply, whole or streamed (:mod:`.relay`); and noting a decode that failed before replying,
for the turn to be served again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from kvturn import headers as h
from kvturn.gateway import tracing
from kvturn.gateway.digests import reply_message
from kvturn.gateway.errors import NoHealthyEngine
from kvturn.gateway.http.upstream import UpstreamUnavailable
from kvturn.gateway.planner import TurnPlan
from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply
from kvturn.gateway.state.table import Taken
from kvturn.gateway.tokens import CHAT_PATH, detokenized
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.migrate import Ledger, Migration, Seam, migratable, wants_usage
from kvturn.gateway.turns.model import (
    DecodeFailed,
    PrefillResult,
    Reuse,
    Turn,
    passthrough,
)
from kvturn.gateway.turns.relay import Relay, reply_start
from kvturn.gateway.turns.replay import Replay, ReplaySeam, Sent, replayable
from kvturn.gateway.turns.settle import After, Settlement
from kvturn.wire import CONVERSATION_KEY, EXPIRES_IN_KEY, LEASE_KEY, PAUSE_KEY, PREFIX_DIGESTS_KEY

logger = logging.getLogger("kvturn.gateway")


class Decoder:
    """Sends a turn to decode (see the module's docstring)."""

    def __init__(
        self,
        context: TurnContext,
        settlement: Settlement,
        resume: Callable[[Turn, Instance | None], Awaitable[Reply]] | None = None,
    ):
        self.context = context
        self.settlement = settlement
        #: Serves a broken stream's continuation (:meth:`~.runner.TurnRunner.resume`).
        self.resume = resume

    def failed(self, failure: DecodeFailed) -> Instance | None:
        """Note a decode that failed before replying; the instance, to avoid on a retry."""
        logger.warning("decode failed before replying (%s); recomputing", failure)
        self.context.metrics.upstream_errors_by["decode"].inc()
        failed = self.context.decode.get(failure.url)
        if failed is not None and failure.unreachable:
            failed.healthy = False
        return failed

    def failed_reuse(self) -> Reuse:
        plan = TurnPlan("recompute", "decode-failed")
        self.context.metrics.fallbacks_by[plan.reason].inc()
        return Reuse(plan)

    async def decode(
        self,
        turn: Turn,
        taken: Taken | None,
        prefilled: PrefillResult,
        *,
        target: Instance | None = None,
        supersedes: str | None = None,
        lease_name: str | None = None,
        avoid: Instance | None = None,
        request_id: str | None = None,
        keep: bool = True,
    ) -> Reply:
        """Decode's reply: after prefill (on a decode other than ``avoid``, if there is one),
        or (``target``, a ``decode-local`` turn) on the holder alone, whose new lease then
        ``supersedes`` the previous one. ``lease_name``: what decode's connector leases the
        KV under, where not the conversation's key (:attr:`~.model.Reuse.lease_name`).
        ``keep=False``: the engine keeps no KV of the turn (a prefill engine serving it
        alone)."""
        conversation = taken.conversation if taken is not None else None
        prefer = conversation.holder_url if conversation else None
        if target is not None:
            instance = target
        else:
            try:
                instance = self.context.decode.choose(prefer=prefer, exclude=avoid)
            except NoHealthyEngine:
                instance = self.context.decode.choose(prefer=prefer)
        # 128 random bits: the reply's id is made of it (no turn counter shows through), and
        # decode publishes the KV it retains under it. (A push turn's prefill shares it.)
        request_id = request_id or turn.engine_request_id()
        body = dict(turn.body)
        migration = self._migration(turn)
        if isinstance(migration, Migration):
            body["return_token_ids"] = True  # what a continuation starts from
        params = dict(prefilled.params)
        # What decode's connector needs to lease the KV this turn leaves (or to free it at
        # once: a turn without a conversation never comes back for it).
        lease_under = (lease_name or conversation.key) if conversation and keep else None
        params[CONVERSATION_KEY] = lease_under
        # The lease this decode grants (its connector cuts a longer one): the client plans its
        # heartbeats from what the header says, so it must never say more.
        lease_s = instance.lease_s(self.context.lease_for(turn))
        params[LEASE_KEY] = lease_s
        if turn.pause is not None:
            params[PAUSE_KEY] = list(turn.pause)
        body["kv_transfer_params"] = params
        plan = prefilled.plan
        response_headers = {
            h.PLAN: plan.plan,
            h.PLAN_REASON: plan.reason,
            h.REUSED_TOKENS: str(prefilled.reused_tokens),
            # The engine request's id (the caller's own, where it sent one, replaces it at the
            # edge): what the engines' logs name the turn by.
            h.REQUEST_ID: request_id,
        }
        if conversation is not None:
            # The id itself, or percent-encoded where it cannot travel as itself.
            response_headers[h.CONVERSATION_ID] = h.conversation_id_header(
                conversation.conversation_id
            )
            response_headers[h.LEASE_SECONDS] = f"{lease_s:g}"
        # Traced (when on) from the request to the end of its reply; the engine's own spans
        # join the trace through its traceparent.
        spans = tracing.start_decode(
            turn.tracer, transfer=turn.stream and prefilled.instance is not None
        )
        sending = _Sending(
            instance.url + turn.path,
            body,
            turn.engine_headers(request_id, spans.context if spans is not None else None),
            response_headers,
            spans,
        )
        after = After(
            taken,
            instance if keep else None,
            request_id,
            supersedes,
            turn.implicit,
            prefilled,
            turn.salt,
            decode_url=instance.url,
            prompt_digest=turn.prompt_digest,
            # Marked after the reply, off the response path, if anything is retained.
            marks=turn if keep and self.context.limits.enabled else None,
        )

        instance.last_sent = time.monotonic()
        try:
            if turn.stream:
                reply = await self._streamed(turn, instance, prefilled, after, sending, migration)
            else:
                reply = await self._whole(turn, instance, prefilled, after, sending)
        except BaseException:
            if spans is not None:
                spans.end()
            raise
        if spans is not None and reply.stream is None:
            spans.end(reply.status)
        return reply

    async def _whole(
        self,
        turn: Turn,
        instance: Instance,
        prefilled: PrefillResult,
        after: After,
        sending: _Sending,
    ) -> Reply:
        """Decode's whole reply (not streamed)."""
        url, body, upstream_headers = sending.url, sending.body, sending.headers
        response_headers, plan = sending.reply_headers, prefilled.plan
        instance.in_flight += 1
        try:
            response = await self.context.upstream.post_json(url, body, upstream_headers)
        except UpstreamUnavailable as error:
            raise DecodeFailed(instance.url, unreachable=not error.local) from error
        except asyncio.CancelledError:
            self._client_left(after, prefilled)
            raise
        finally:
            instance.in_flight -= 1
        if response.status >= 500:
            raise DecodeFailed(instance.url, unreachable=False)
        if response.status != 200:
            after.holder, prefilled.uncounted = None, None  # no turn to count
            self.settlement.settle_later(after)
            return passthrough(response.status, response.body, response_headers)
        payload = response.body
        data = response.json()
        if plan.local:
            # The holder says how much its prefix cache served.
            cached = (data.get("usage") or {}).get("prompt_tokens_details") or {}
            if "cached_tokens" in cached:
                prefilled.reused_tokens = int(cached["cached_tokens"] or 0)
                response_headers[h.REUSED_TOKENS] = str(prefilled.reused_tokens)
        self.settlement.count(prefilled, instance)
        after.retained = retained_in(data.get("kv_transfer_params"))
        if after.retained is None and after.holder is not None:
            # Decode did not say where the KV stays: the record waits on asking it.
            self.settlement.mark_settling(after)
        if data.get("kv_transfer_params") is not None:
            # Engine-internal: shown to callers as one engine alone shows it (null).
            data["kv_transfer_params"] = None
            payload = orjson.dumps(data)
        if turn.implicit is not None:
            after.reply = reply_message(data)
        self.settlement.settle_later(after)
        return Reply(200, payload, response_headers)

    def _client_left(self, after: After, prefilled: PrefillResult) -> None:
        """The client left before decode replied: the engine request was closed (vLLM aborts
        it). Free what decode may keep of it, as for a stream the client left; the turn is not
        counted, since it never answered."""
        after.holder, after.incomplete = None, True
        prefilled.uncounted = None
        self.settlement.settle_later(after)

    async def _streamed(
        self,
        turn: Turn,
        instance: Instance,
        prefilled: PrefillResult,
        after: After,
        sending: _Sending,
        migration: Migration | Replay | None = None,
    ) -> Reply:
        """Decode's reply as a stream, relayed as it comes (:class:`~.relay.Relay`)."""
        url, body, upstream_headers = sending.url, sending.body, sending.headers
        response_headers = sending.reply_headers
        instance.in_flight += 1
        sent = time.perf_counter()
        try:
            upstream = await self.context.upstream.open_stream(url, body, upstream_headers)
        except UpstreamUnavailable as error:
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=not error.local) from error
        head: list[bytes] | None = []
        try:
            if upstream.status == 200:
                head = await reply_start(upstream)
        except UpstreamUnavailable as error:
            await upstream.aclose()
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=not error.local) from error
        except asyncio.CancelledError:
            await upstream.aclose()
            instance.in_flight -= 1
            self._client_left(after, prefilled)
            raise
        if upstream.status >= 500 or head is None:
            # Decode failed before replying (a 5xx, or an error event before any token): the
            # turn can be served again.
            await upstream.aclose()
            instance.in_flight -= 1
            raise DecodeFailed(instance.url, unreachable=False)
        self.settlement.mark_settling(after)
        if upstream.status != 200:
            try:
                payload = await upstream.read()
            except Exception:
                payload = b""
            await upstream.aclose()
            instance.in_flight -= 1
            after.holder, prefilled.uncounted = None, None  # no turn to count
            self.settlement.settle_later(after)
            return passthrough(upstream.status, payload, response_headers)
        relay = Relay(
            self.settlement,
            upstream,
            instance,
            prefilled,
            after,
            turn.started,
            sent,
            sending.spans,
            head=head,
            migration=migration,
            # Nothing from a hung engine for as long as health checks take to find it.
            hang_quiet_s=self.context.config.health_interval_s,
        )
        return Reply(200, headers=response_headers, stream=relay)

    def _migration(self, turn: Turn) -> Migration | Replay | None:
        """What a streamed reply needs to continue on another engine if its decode breaks off
        mid-way, where it may: a continuation (:mod:`.migrate`), or else a replay
        (:mod:`.replay`)."""
        limit = self.context.config.migration_limit
        if self.resume is None or limit <= 0 or turn.resumes:
            return None
        if not migratable(turn.path, turn.body):
            if not replayable(turn.path, turn.body):
                return None
            sent = Sent()
            return Replay(turn, sent, ReplaySeam(sent), limit, self.resume)
        ledger = Ledger(
            chat=turn.path == CHAT_PATH, client_ids=bool(turn.body.get("return_token_ids"))
        )
        model = turn.body.get("model")

        async def detokenize(ids: list[int]) -> str | None:
            for instance in (*self.context.prefill.healthy(), *self.context.decode.healthy()):
                text = await detokenized(self.context.upstream, instance.url, model, ids)
                if text is not None:
                    return text
            return None

        return Migration(
            turn, ledger, Seam(ledger, wants_usage(turn.body)), limit, self.resume, detokenize
        )


@dataclass(slots=True)
class _Sending:
    """One decode request: where, what, with which headers; the reply's headers; its spans."""

    url: str
    body: dict[str, Any]
    headers: dict[str, str]
    reply_headers: dict[str, str]
    spans: tracing.DecodeSpans | None


def retained_in(params: Any) -> dict[str, Any] | None:
    """The lease a decode's non-streamed reply describes (the kvturn connector's params), if
    it describes one."""
    if isinstance(params, dict) and EXPIRES_IN_KEY in params and PREFIX_DIGESTS_KEY in params:
        return params
    return None
