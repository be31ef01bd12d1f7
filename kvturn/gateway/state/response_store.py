"""Where the Responses API's stored responses live: what a turn chained by
``previous_response_id`` (or naming a ``conversation``) needs to rebuild its full input.

Two implementations behind one small interface: in this process (the default; bounded, least
recently used dropped first) and Redis (``--state redis://…``: shared by every gateway process
and replica, and kept across gateway restarts). Entries expire ``ttl_s`` after they were
stored in both. Everything is per tenant.

A Redis that cannot be reached is never silently taken for "not found": a lookup fails with a
503 (``state_unavailable``, which the SDKs retry), and a store that fails is logged and counted
(the reply the client waits for is sent all the same; only chaining to it will fail).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from kvturn.gateway.errors import StateUnavailable
from kvturn.gateway.state.keys import tenant_digest
from kvturn.gateway.state.redis_client import RedisState

logger = logging.getLogger("kvturn.gateway.state")


@dataclass(slots=True)
class StoredResponse:
    """What a later turn chained to a response needs, and what ``GET`` returns."""

    response: dict[str, Any]
    #: The chat messages the response's turn saw (its instructions left out) and its reply.
    messages: list[dict[str, Any]]
    #: The conversation the turn belonged to (its KV holder is found by it), if any.
    conversation_id: str | None


class ResponseStore(Protocol):
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def put(
        self,
        tenant: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        conversation_id: str | None,
    ) -> None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def conversation(self, tenant: str, conversation_id: str) -> list[Any] | None:
        """The history a ``conversation``'s next turn starts from."""

    async def put_conversation(
        self, tenant: str, conversation_id: str, messages: list[dict[str, Any]]
    ) -> None: ...


class MemoryResponseStore:
    """In this process: least recently used dropped past ``max_entries`` (of responses, and
    of conversations), each gone ``ttl_s`` after it was stored."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._responses: OrderedDict[tuple[str, str], tuple[StoredResponse, float]] = OrderedDict()
        self._conversations: OrderedDict[tuple[str, str], tuple[list[Any], float]] = OrderedDict()
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self._find(self._responses, (tenant, response_id))

    async def put(
        self,
        tenant: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        conversation_id: str | None,
    ) -> None:
        stored = StoredResponse(response, messages, conversation_id)
        self._add(self._responses, (tenant, response["id"]), stored)

    async def delete(self, tenant: str, response_id: str) -> bool:
        found = self._find(self._responses, (tenant, response_id))
        return found is not None and bool(self._responses.pop((tenant, response_id)))

    async def conversation(self, tenant: str, conversation_id: str) -> list[Any] | None:
        return self._find(self._conversations, (tenant, conversation_id))

    async def put_conversation(
        self, tenant: str, conversation_id: str, messages: list[dict[str, Any]]
    ) -> None:
        self._add(self._conversations, (tenant, conversation_id), messages)

    def _add(self, items: OrderedDict[Any, Any], key: tuple[str, str], value: Any) -> None:
        items[key] = (value, self._clock() + self.ttl_s)
        items.move_to_end(key)
        while len(items) > self.max_entries:
            items.popitem(last=False)

    def _find(self, items: OrderedDict[Any, Any], key: tuple[str, str]) -> Any:
        found = items.get(key)
        if found is None:
            return None
        if found[1] <= self._clock():
            del items[key]
            return None
        items.move_to_end(key)
        return found[0]


class RedisResponseStore:
    """In Redis (``redis://host:port/db``): one key per response and per conversation, each
    set with its expiry (``SET … EX``); how much Redis holds is bounded by the expiry and the
    server's own ``maxmemory`` policy. Values are JSON. Shares the gateway's one state client
    (:class:`~.redis_client.RedisState`: its timeout, prefix and error count); a failed call is
    logged each time."""

    def __init__(self, redis: RedisState, ttl_s: float):
        self._redis = redis.client
        self._errors = redis.errors
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = redis.prefix
        #: Called with the operation's name when Redis fails (a metric).
        self.on_error = redis.on_error

    def _key(self, kind: str, tenant: str, name: str) -> str:
        # A digest of the tenant and the client's name (a response id, a conversation id: any
        # characters), under a namespace of the store's own: no tenant or name reaches into
        # another's keys, nor into the conversation table's (``{prefix}conv:…``).
        return f"{self.prefix}responses:{kind}:{tenant_digest('responses-' + kind, tenant, name)}"

    async def _get(self, op: str, key: str) -> Any:
        try:
            raw = await self._redis.get(key)
        except self._errors as error:
            self.on_error(op)
            logger.warning("state store: %s failed: %s", op, error)
            raise StateUnavailable("the gateway's state store is unavailable") from None
        return None if raw is None else orjson.loads(raw)

    async def _set(self, op: str, key: str, value: Any) -> None:
        try:
            await self._redis.set(key, orjson.dumps(value), px=self.ttl_ms)
        except self._errors as error:
            self.on_error(op)
            logger.warning("state store: %s failed (chaining to it will fail): %s", op, error)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        found = await self._get("get_response", self._key("resp", tenant, response_id))
        if found is None:
            return None
        return StoredResponse(found["response"], found["messages"], found["conversation_id"])

    async def put(
        self,
        tenant: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        conversation_id: str | None,
    ) -> None:
        value = {"response": response, "messages": messages, "conversation_id": conversation_id}
        await self._set("put_response", self._key("resp", tenant, response["id"]), value)

    async def delete(self, tenant: str, response_id: str) -> bool:
        try:
            return bool(await self._redis.delete(self._key("resp", tenant, response_id)))
        except self._errors as error:
            self.on_error("delete_response")
            logger.warning("state store: delete failed: %s", error)
            raise StateUnavailable("the gateway's state store is unavailable") from None

    async def conversation(self, tenant: str, conversation_id: str) -> list[Any] | None:
        found = await self._get("get_conversation", self._key("conv", tenant, conversation_id))
        return found if isinstance(found, list) else None

    async def put_conversation(
        self, tenant: str, conversation_id: str, messages: list[dict[str, Any]]
    ) -> None:
        await self._set("put_conversation", self._key("conv", tenant, conversation_id), messages)
