"""Where a turn is computed when it is not decode-local: P/D (prefill, pulling the previous
KV if planning claimed it, or recomputing; then decode), or one side alone when the other has
no engine that answers. Push P/D is :mod:`.push`."""

from __future__ import annotations

import logging
import time

from kvturn.gateway.errors import NoHealthyEngine, UpstreamError
from kvturn.gateway.http.upstream import UpstreamResponse, UpstreamUnavailable
from kvturn.gateway.planner import TurnPlan
from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply
from kvturn.gateway.state.table import Taken
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.decode import Decoder
from kvturn.gateway.turns.model import (
    RECOMPUTE_PARAMS,
    DecodeFailed,
    PrefillResult,
    Reuse,
    Turn,
    passthrough,
    prefill_body,
    prioritized,
    status_text,
)
from kvturn.gateway.turns.placement import choose_prefill
from kvturn.wire import PREFILL_CACHED_KEY

logger = logging.getLogger("kvturn.gateway")


class Dispatch:
    """P/D with a pull or a recompute; a decode or a prefill serving a turn alone."""

    def __init__(self, context: TurnContext, decoder: Decoder):
        self.context = context
        self.decoder = decoder

    async def prefill(self, turn: Turn, reuse: Reuse) -> PrefillResult | Reply:
        plan = reuse.plan
        params = reuse.params
        claimed = reuse.claimed
        body = prefill_body(turn.body, params)
        if plan.pulls:
            body = prioritized(body, self.context.config.pull_priority)
        attempts = 0
        tried: Instance | None = None
        response: UpstreamResponse | None = None
        while True:
            attempts += 1
            try:
                instance = choose_prefill(self.context.prefill, turn, exclude=tried)
            except NoHealthyEngine:
                if tried is None:
                    raise
                raise UpstreamError(f"prefill failed ({status_text(response)})") from None
            instance.in_flight += 1
            started = time.perf_counter()
            try:
                response = await self.context.upstream.post_json(
                    instance.url + turn.path, body, turn.engine_headers(turn.engine_request_id())
                )
            except UpstreamUnavailable as error:
                if not error.local:  # out of descriptors: not the engine's fault
                    instance.healthy = False
                response = None
            finally:
                instance.in_flight -= 1
            if response is not None and response.status == 200:
                break
            if response is not None and 400 <= response.status < 500 and params is RECOMPUTE_PARAMS:
                return passthrough(response.status, response.body)
            self.context.metrics.upstream_errors_by["prefill"].inc()
            if params is not RECOMPUTE_PARAMS:
                # vLLM answers a declined or failed pull with an error: retry as plain recompute.
                logger.warning("prefill with reuse failed (%s); recomputing", status_text(response))
                if claimed is not None and response is not None:
                    # Prefill answered: its read is over, whatever became of it.
                    self.context.release_later(*claimed, claimed=True)
                claimed = None
                params, plan = RECOMPUTE_PARAMS, TurnPlan("recompute", "pull-failed")
                self.context.metrics.fallbacks_by[plan.reason].inc()
                body = prefill_body(turn.body, params)
                continue  # same or another instance: a failed pull says nothing about its health
            if attempts >= 3 or not self.context.prefill.healthy():
                if response is None:
                    raise NoHealthyEngine("no prefill engine answered")
                raise UpstreamError(f"prefill failed with HTTP {response.status}")
            tried = instance

        finished = time.perf_counter()
        self.context.metrics.prefill_seconds_by[plan.plan].observe(finished - started)
        data = response.json()
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        decode_params = dict(data.get("kv_transfer_params") or {})
        if not decode_params:
            raise UpstreamError("prefill returned no kv_transfer_params (is it a kvturn engine?)")
        # Cached tokens are prefill's own prefix-cache hits plus what it pulled, if it pulled;
        # its connector says how many were its own (vLLM pulls only what its cache lacks).
        own = decode_params.pop(PREFILL_CACHED_KEY, None)
        pulled = 0
        if plan.pulls:
            pulled = max(0, reused - own) if isinstance(own, int) else reused
        # A turn that did not pull computed only the rest, and says nothing of a pull's cost.
        self.context.costs.observe_prefill(
            instance.url, prompt_tokens - reused, pulled, finished - started
        )
        if reuse.plan.reason == "holder-draining":
            outcome = "lost" if not plan.pulls else "pulled" if pulled else "cached"
            self.context.metrics.drain_handoffs_by[outcome].inc()
        if plan.pulls and pulled == 0:
            # Nothing was read: the prompt shares no verified prefix with the lease, or
            # prefill's own cache already held what the lease did. Its claim is freed now, not
            # when it times out.
            plan = TurnPlan("recompute", "prefill-cached" if reused else "no-common-prefix")
            self.context.metrics.fallbacks_by[plan.reason].inc()
            if claimed is not None:
                self.context.release_later(*claimed, claimed=True)
        decode_params["remote_host"] = instance.host
        return PrefillResult(instance, decode_params, prompt_tokens, reused, plan, finished)

    async def decode_alone(
        self, turn: Turn, taken: Taken | None, reason: str, avoid: Instance | None
    ) -> Reply:
        """The turn on a decode engine by itself (no prefill could serve it), which computes
        the whole prompt, or what its prefix cache lacks (the holder is preferred); its KV is
        kept for the next turn as after a decode-local turn. No decode either: the 503."""
        plan = TurnPlan("recompute", reason)
        self.context.metrics.fallbacks_by[reason].inc()
        alone = PrefillResult(None, {}, 0, 0, plan)
        try:
            return await self.decoder.decode(turn, taken, alone, avoid=avoid)
        except DecodeFailed as failure:
            avoid = self.decoder.failed(failure)
        try:
            return await self.decoder.decode(turn, taken, alone, avoid=avoid)
        except DecodeFailed as failure:
            self.decoder.failed(failure)
            raise UpstreamError(f"prefill and decode failed ({failure})") from None

    async def prefill_alone(self, turn: Turn, taken: Taken | None, reason: str) -> Reply:
        """No decode can take the turn (none is healthy, or decode failed twice): a prefill
        engine, a whole vLLM engine too, serves it alone, as one engine would. Prefill engines
        hold no conversation's KV, so nothing is kept for the next turn (it recomputes, on a
        decode again once one is back). No prefill either: the 503 stands."""
        plan = TurnPlan("recompute", reason)
        self.context.metrics.fallbacks_by[reason].inc()
        logger.warning("no decode engine can serve the turn (%s); prefill serves it alone", reason)
        instance = self.context.prefill.choose()
        alone = PrefillResult(None, {}, 0, 0, plan)
        try:
            return await self.decoder.decode(turn, taken, alone, target=instance, keep=False)
        except DecodeFailed as failure:
            self.context.metrics.upstream_errors_by["prefill"].inc()
            if failure.unreachable:
                instance.healthy = False
            raise UpstreamError(f"no decode engine, and prefill failed too ({failure})") from None
