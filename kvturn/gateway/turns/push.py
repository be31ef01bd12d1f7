"""Push P/D (``transfer="push"``): decode registers its blocks with prefill while prefill
computes, and prefill WRITEs the KV into them, so both are sent the turn at once, under one
request id (how upstream's push pairs the two requests)."""

from __future__ import annotations

import asyncio
import logging
import time

from kvturn.gateway import tracing
from kvturn.gateway.errors import NoHealthyEngine
from kvturn.gateway.http.upstream import UpstreamUnavailable
from kvturn.gateway.planner import TurnPlan
from kvturn.gateway.pools import Instance
from kvturn.gateway.replies import Reply
from kvturn.gateway.state.table import Taken
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.decode import Decoder
from kvturn.gateway.turns.dispatch import Dispatch
from kvturn.gateway.turns.model import (
    RECOMPUTE_PARAMS,
    DecodeFailed,
    PrefillResult,
    Turn,
    prefill_body,
    status_text,
)
from kvturn.gateway.turns.placement import choose_prefill
from kvturn.gateway.turns.relay import cancel_reply, streamed

logger = logging.getLogger("kvturn.gateway")


class PushDispatch:
    """Serves a turn by push P/D, falling back as :meth:`serve` says."""

    def __init__(self, context: TurnContext, decoder: Decoder, dispatch: Dispatch):
        self.context = context
        self.decoder = decoder
        self.dispatch = dispatch

    async def serve(
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
                return await self.push_turn(turn, taken, plan, avoid=failed)
            except DecodeFailed as failure:
                failed = self.decoder.failed(failure)
                plan = self.decoder.failed_reuse().plan
        return await self.dispatch.prefill_alone(turn, taken, "decode-failed-twice")

    async def push_turn(
        self, turn: Turn, taken: Taken | None, plan: TurnPlan, avoid: Instance | None
    ) -> Reply:
        try:
            prefill = choose_prefill(self.context.prefill, turn)
        except NoHealthyEngine:
            return await self.dispatch.decode_alone(turn, taken, "no-prefill", avoid)
        assert prefill.control_url is not None  # GatewayConfig checks it for push
        identity = prefill.identity
        if identity is None:
            identity = prefill.identity = await self.context.leases.identity(prefill.control_url)
        if identity is None:
            logger.warning("prefill %s: no NIXL identity from its control server", prefill.url)
            prefill.healthy = False
            return await self.dispatch.decode_alone(turn, taken, "prefill-unreachable", avoid)
        request_id = turn.engine_request_id()
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
            decode = self.context.decode.choose(
                prefer=conversation.holder_url if conversation else None, exclude=avoid
            )
        except NoHealthyEngine:
            try:
                decode = self.context.decode.choose()
            except NoHealthyEngine:
                return await self.dispatch.prefill_alone(turn, taken, "no-decode")
        prefilling = asyncio.ensure_future(self.prefill(turn, prefill, request_id, pushed))
        decoding = asyncio.ensure_future(
            self.decoder.decode(turn, taken, pushed, target=decode, request_id=request_id)
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
                await cancel_reply(decoding)
                return await self.dispatch.decode_alone(turn, taken, "prefill-failed", avoid)
            # Prefill computed the prompt and writes it now. Nothing tells decode if that
            # write fails (or prefill dies first): it would wait for good. Ask it.
            watching = asyncio.ensure_future(self.arrives(decode, request_id))
            await asyncio.wait({watching, decoding}, return_when=asyncio.FIRST_COMPLETED)
            if decoding.done() and (decoding.exception() is not None or not streamed(decoding)):
                return decoding.result()  # a whole reply, or decode failed: pushed again
            arrived = await watching
            if arrived is None and await self.context.upstream.is_healthy(decode.url) is False:
                # Decode died while it waited (its stream has sent nothing yet): push again.
                await cancel_reply(decoding)
                raise DecodeFailed(decode.url, unreachable=True)
            if arrived is False:
                logger.warning(
                    "decode %s never got the KV prefill pushed; serving alone", decode.url
                )
                await cancel_reply(decoding)
                return await self.dispatch.decode_alone(turn, taken, "push-lost", avoid)
            return await decoding
        except BaseException:
            prefilling.cancel()
            if watching is not None:
                watching.cancel()
            await cancel_reply(decoding)
            raise
        finally:
            if watching is not None and not watching.done():
                watching.cancel()

    async def arrives(self, decode: Instance, request_id: str) -> bool | None:
        """Whether the KV prefill pushed reaches ``decode``: False once decode has awaited it
        for ``push_write_timeout_s`` (time it spends queued, not yet scheduled, is not
        counted: it registers, and prefill writes, when it is); None if decode cannot say."""
        if decode.control_url is None:
            return None
        loop = asyncio.get_running_loop()
        timeout_s = self.context.config.push_write_timeout_s
        deadline = loop.time() + timeout_s
        # Bounded like any engine request: a decode that never schedules it cannot be judged.
        give_up = loop.time() + self.context.config.request_timeout_s
        while loop.time() < give_up:
            wait_s = max(0.0, min(deadline - loop.time(), 5.0))
            state = await self.context.leases.push_state(decode.control_url, request_id, wait_s)
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

    async def prefill(
        self, turn: Turn, prefill: Instance, request_id: str, pushed: PrefillResult
    ) -> bool:
        """Prefill's half of a push turn; whether it computed the prompt (and so writes it)."""
        body = prefill_body(turn.body, RECOMPUTE_PARAMS)
        prefill.in_flight += 1
        started = time.perf_counter()
        try:
            with tracing.phase(turn.tracer, "kvturn.prefill"):
                response = await self.context.upstream.post_json(
                    prefill.url + turn.path, body, turn.engine_headers(request_id)
                )
        except UpstreamUnavailable as error:
            if not error.local:  # out of descriptors: not the engine's fault
                prefill.healthy = False
            response = None
        finally:
            prefill.in_flight -= 1
        if response is None or response.status != 200:
            logger.warning(
                "push prefill failed (%s); serving on decode alone", status_text(response)
            )
            self.context.metrics.upstream_errors_by["prefill"].inc()
            return False
        pushed.finished_at = time.perf_counter()
        self.context.metrics.prefill_seconds_by[pushed.plan.plan].observe(
            pushed.finished_at - started
        )
        usage = response.json().get("usage") or {}
        pushed.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        seconds = pushed.finished_at - started
        self.context.costs.observe_prefill(prefill.url, pushed.prompt_tokens, 0, seconds)
        return True
