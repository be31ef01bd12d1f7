"""The order a turn is served in, and its fallbacks (the rooms it passes through are listed in
:mod:`kvturn.gateway.turns`).

A turn is planned (:mod:`.reuse`); a ``decode-local`` one goes to the holder alone; the others
go through P/D (:mod:`.dispatch`, or :mod:`.push`), once more from scratch if decode fails
before replying. Where one side has no engine left that answers, the other side's engine
serves the turn alone. No turn fails because reuse did: a lapsed lease, a dead holder or a
failed pull is a recompute.
"""

from __future__ import annotations

import time

from kvturn.gateway import tracing
from kvturn.gateway.batches import batched_prompts, serve_batch
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.errors import NoHealthyEngine, UpstreamError
from kvturn.gateway.http.upstream import Upstream
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.planner import TurnPlan
from kvturn.gateway.pools import Instance, Pool
from kvturn.gateway.replies import Reply
from kvturn.gateway.state.table import Conversation, ConversationTable, Taken
from kvturn.gateway.turns.context import TurnContext
from kvturn.gateway.turns.decode import Decoder
from kvturn.gateway.turns.dispatch import Dispatch
from kvturn.gateway.turns.model import DecodeFailed, PrefillResult, Reuse, Turn
from kvturn.gateway.turns.push import PushDispatch
from kvturn.gateway.turns.reuse import ReuseStep
from kvturn.gateway.turns.settle import Settlement

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
        self.context = TurnContext.create(config, prefill, decode, upstream, store, metrics)
        self.reuse = ReuseStep(self.context)
        self.settlement = Settlement(self.context)
        self.decoder = Decoder(self.context, self.settlement, resume=self.resume)
        self.dispatch = Dispatch(self.context, self.decoder)
        self.push = PushDispatch(self.context, self.decoder, self.dispatch)

    @property
    def turns_served(self) -> int:
        """Turns this process served (its share under several workers; /kvturn/status)."""
        return self.settlement.turns_served

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
                [self.serve(sub, None) for sub in subturns],
                stream=turn.stream,
                choices_per_prompt=int(turn.body.get("n") or 1),
                window=turn.window,
                lane=self.context.lane,
            )
        return await self.serve(turn, await self.reuse.take(turn))

    async def serve(self, turn: Turn, taken: Taken | None) -> Reply:
        """Plan; then the holder decode alone, or prefill then decode; once more from
        scratch if decode fails before replying. Where one side has no engine left that
        answers, the other side's engine serves the turn alone."""
        conversation = taken.conversation if taken is not None else None
        self.wake_decode(conversation, turn)
        with tracing.phase(turn.tracer, "kvturn.plan"):
            reuse = await self.reuse.plan(turn, conversation)
        failed: Instance | None = reuse.avoid
        if reuse.plan.local:
            assert reuse.holder is not None
            if reuse.holder.control_url is not None:
                # Sent now: the engine steps often until the request is there.
                wake = self.context.leases.wake(
                    reuse.holder.control_url, within_ms=LOCAL_ARRIVAL_MS
                )
                self.context.background_task(wake)
            local = PrefillResult(
                None,
                {},
                reuse.prompt_tokens,
                reuse.reused_tokens,
                reuse.plan,
                uncounted=reuse.uncounted,
            )
            try:
                return await self.decoder.decode(
                    turn,
                    taken,
                    local,
                    target=reuse.holder,
                    supersedes=reuse.previous_key,
                    lease_name=reuse.lease_name,
                )
            except DecodeFailed as failure:
                failed = self.decoder.failed(failure)
                if reuse.previous_key is not None:
                    self.context.release_later(reuse.holder, reuse.previous_key, claimed=True)
                reuse = self.decoder.failed_reuse()
        return await self._through_pd(turn, taken, reuse, failed)

    async def resume(self, turn: Turn, broken_on: Instance | None) -> Reply:
        """A broken stream's continuation (:mod:`.migrate`), through P/D on a decode other
        than the one it broke on: prefill's prefix cache holds the prompt it computed for the
        turn; the continuation keeps no KV (its conversation's next turn recomputes)."""
        return await self._through_pd(
            turn, None, Reuse(TurnPlan("recompute", "migrated")), broken_on
        )

    async def _through_pd(
        self, turn: Turn, taken: Taken | None, reuse: Reuse, failed: Instance | None
    ) -> Reply:
        """Prefill then decode, once more from scratch if decode fails before replying."""
        if self.context.config.transfer == "push":
            return await self.push.serve(turn, taken, reuse.plan, failed)
        for _ in range(2):
            if not self.context.decode.healthy():
                return await self.dispatch.prefill_alone(turn, taken, "no-decode")
            try:
                with tracing.phase(turn.tracer, "kvturn.prefill"):
                    prefilled = await self.dispatch.prefill(turn, reuse)
            except NoHealthyEngine:
                return await self.dispatch.decode_alone(turn, taken, "no-prefill", failed)
            except UpstreamError:
                return await self.dispatch.decode_alone(turn, taken, "prefill-failed", failed)
            if isinstance(prefilled, Reply):
                return prefilled
            try:
                return await self.decoder.decode(turn, taken, prefilled, avoid=failed)
            except DecodeFailed as failure:
                # Decode died, or failed its pull from prefill, before replying: serve the turn
                # again from scratch, on another decode if there is one.
                failed = self.decoder.failed(failure)
                reuse = self.decoder.failed_reuse()
            except NoHealthyEngine:
                return await self.dispatch.prefill_alone(turn, taken, "no-decode")
        return await self.dispatch.prefill_alone(turn, taken, "decode-failed-twice")

    def wake_decode(self, conversation: Conversation | None, turn: Turn) -> None:
        """An idle decode paces its empty steps (up to a quarter second apart while it holds
        leases): tell the one this turn will likely use, while prefill runs, unless it was
        busy lately (see ``WAKE_AFTER_IDLE_S``)."""
        prefer = conversation.holder_url if conversation else None
        if prefer is None and turn.source is not None:
            prefer = turn.source.holder_url
        try:
            target = self.context.decode.choose(prefer=prefer)
        except NoHealthyEngine:
            return
        now = time.monotonic()
        if (
            target.in_flight == 0
            and target.control_url is not None
            and now - target.last_sent >= WAKE_AFTER_IDLE_S
        ):
            target.last_sent = now
            self.context.background_task(self.context.leases.wake(target.control_url))

    async def close(self, grace_s: float = 2.0) -> None:
        """Let the turns' background work finish for up to ``grace_s``, then cancel it
        (:meth:`~.context.TurnContext.close`)."""
        await self.context.close(grace_s)
