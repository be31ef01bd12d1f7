"""Plan a turn: pull the conversation's KV from its holder decode, or recompute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvturn.gateway.conversations import Conversation

PlanName = Literal["recompute", "pull-reuse"]


@dataclass(frozen=True, slots=True)
class TurnPlan:
    plan: PlanName
    #: Why: ``reuse``, ``no-conversation``, ``first-turn``, ``lease-expired``,
    #: ``holder-unhealthy``, ``below-threshold``.
    reason: str

    @property
    def reuses(self) -> bool:
        return self.plan == "pull-reuse"


RECOMPUTE_NO_CONVERSATION = TurnPlan("recompute", "no-conversation")


def plan_turn(
    conversation: Conversation | None,
    now: float,
    *,
    holder_healthy: bool,
    expiry_margin_s: float,
    threshold_tokens: int,
) -> TurnPlan:
    """Decide how to serve the next turn of ``conversation`` (pure: no I/O, injected time)."""
    if conversation is None:
        return RECOMPUTE_NO_CONVERSATION
    if conversation.holder_url is None:
        return TurnPlan("recompute", "first-turn")
    if not conversation.has_live_kv(now, expiry_margin_s):
        return TurnPlan("recompute", "lease-expired")
    if not holder_healthy:
        return TurnPlan("recompute", "holder-unhealthy")
    if conversation.held_tokens < threshold_tokens:
        return TurnPlan("recompute", "below-threshold")
    return TurnPlan("pull-reuse", "reuse")
