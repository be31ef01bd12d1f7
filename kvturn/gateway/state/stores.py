"""A gateway's state, as its ``state`` setting names it: every store in this process, or every
store in one Redis, reached through one client (:class:`~.redis_client.RedisState`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvturn.gateway.state.redis_client import RedisState, uses_redis
from kvturn.gateway.state.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from kvturn.gateway.state.table import ConversationTable
from kvturn.gateway.state.table_in_process import ConversationStore
from kvturn.gateway.state.table_redis import RedisConversations


@dataclass(frozen=True, slots=True)
class GatewayState:
    """The conversation table (with its implicit index) and the response store, and the Redis
    they share (``None``: they live in this process)."""

    table: ConversationTable
    responses: ResponseStore
    redis: RedisState | None = None

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()


def open_state(
    url: str | None,
    *,
    max_conversations: int,
    idle_s: float,
    max_responses: int,
    responses_ttl_s: float,
    timeout_s: float,
    on_error: Callable[[str], None] | None = None,
) -> GatewayState:
    """The stores ``url`` names (:func:`~.redis_client.uses_redis`). ``max_conversations`` and
    ``max_responses`` bound the in-process stores; in Redis, a conversation's entry is kept
    ``idle_s`` after its last write and a stored response ``responses_ttl_s``. ``timeout_s``
    bounds every Redis call; ``on_error`` counts the failed ones by operation."""
    if not uses_redis(url):
        return GatewayState(
            ConversationStore(max_conversations),
            MemoryResponseStore(max_responses, responses_ttl_s),
        )
    assert url is not None
    redis = RedisState(url, timeout_s=timeout_s, on_error=on_error)
    return GatewayState(
        RedisConversations(redis, idle_s), RedisResponseStore(redis, responses_ttl_s), redis
    )
