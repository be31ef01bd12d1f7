"""The conversation table in Redis (``--state redis://…``): shared by every gateway worker and
replica, and kept across gateway restarts (see :mod:`.table` for the contract).

Each atomic step is one Lua script (``scripts/*.lua``, loaded by :mod:`.lua` and registered
with redis-py's ``register_script`` on the state's one client, :mod:`.redis_client`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvturn.gateway.state import lua
from kvturn.gateway.state.implicit import Indexed, RedisImplicitIndex
from kvturn.gateway.state.redis_client import RedisState
from kvturn.gateway.state.table import Conversation, Held, Recorded, Taken


class RedisConversations:
    """The table in Redis (``redis://host:port/db``), shared by every worker and replica.

    One hash per conversation under ``{prefix}conv:{key}``, kept ``idle_s`` after its last
    write (a turn, a record, a heartbeat); a sorted set of lease expiries counts live leases
    without scanning. Times are wall-clock seconds (replicas on several hosts share them; keep
    their clocks in sync, as for any lease). Every operation is one round trip.
    """

    def __init__(
        self,
        redis: RedisState,
        idle_s: float,
        *,
        clock: Callable[[], float] = time.time,
        settle_poll_s: float = 0.005,
    ):
        self._redis = redis
        self._client = redis.client
        self.clock = clock
        self.ttl_ms = max(1, int(idle_s * 1000))
        self.prefix = redis.prefix
        #: Sorted sets (member: entry key): lease expiry, and last use (what counts take).
        self._live = f"{self.prefix}live-leases"
        self._seen = f"{self.prefix}conversations"
        self.settle_poll_s = settle_poll_s
        self._take = self._client.register_script(lua.script("take"))
        self._settling = self._client.register_script(lua.script("settling"))
        self._record = self._client.register_script(lua.script("record"))
        self._lookup = self._client.register_script(lua.script("lookup"))
        self._renewed = self._client.register_script(lua.script("renewed"))
        self._remove = self._client.register_script(lua.script("remove"))
        self.implicit = RedisImplicitIndex(redis)

    def _key(self, key: str) -> str:
        return f"{self.prefix}conv:{key}"

    async def _call(self, op: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            result = await script(keys=list(keys), args=list(args))
        except self._redis.errors as error:
            raise self._redis.failed(op, error) from None
        self._redis.succeeded()
        return result

    @property
    def reachable(self) -> bool:
        return self._redis.reachable

    async def take(
        self,
        key: str,
        conversation_id: str,
        turn_id: str | None,
        wait_s: float = 0.0,
        after_turn: int | None = None,
    ) -> Taken:
        # One round trip unless a reply is being recorded: then poll until it is, for up to
        # ``wait_s``. A reply is marked as it starts, so the mark may be as old as the reply
        # is long: any mark younger than an entry's lifetime counts (one left by a gateway
        # that died mid-turn costs the next turn ``wait_s``, and the next record clears it).
        keys = (self._key(key), self._live, self._seen)
        epoch = int.from_bytes(os.urandom(7))
        deadline = time.monotonic() + wait_s
        while True:
            waiting = wait_s > 0 and time.monotonic() < deadline
            window = self.ttl_ms / 1000 if waiting else ""
            after = "" if after_turn is None else after_turn
            args = (conversation_id, turn_id or "", self.clock(), self.ttl_ms, epoch, window, after)
            raw = await self._call("take", self._take, keys, args)
            if len(raw) != 2 or _text(raw[0]) != "settling":
                break
            await asyncio.sleep(self.settle_poll_s)
        fields = _pairs(raw)
        conversation = _conversation(key, fields)
        if fields.get("moved") == "1":
            return Taken(conversation, 0, False, moved_on=True)
        return Taken(conversation, conversation.turns, fields.get("retry") == "1")

    def settling(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None = None,
        findable: tuple[bytes, Indexed] | None = None,
    ) -> Awaitable[None]:
        index_key, index_value = self.implicit.item(*findable) if findable else ("", b"")
        args = (
            turn,
            self.clock(),
            self.ttl_ms,
            fresh.conversation_id if fresh is not None else "",
            fresh.epoch if fresh is not None else "",
            index_value,
        )
        keys = (self._key(key), self._seen, index_key)
        call = self._call("settling", self._settling, keys, args)
        return asyncio.get_running_loop().create_task(call)

    async def record(
        self,
        key: str,
        epoch: int,
        turn: int,
        held: Held | None,
        *,
        fresh: Conversation | None = None,
        findable: tuple[bytes, Indexed] | None = None,
    ) -> Recorded:
        now = self.clock()
        index_key, index_value = self.implicit.item(*findable) if findable else ("", b"")
        args: list[Any] = [
            epoch,
            turn,
            self.ttl_ms,
            now,
            fresh.conversation_id if fresh is not None else "",
            index_value,
        ]
        if held is not None:
            args += [
                held.holder_url,
                held.request_id,
                held.held_tokens,
                held.held_digest or "",
                held.held_digest_tokens if held.held_digest else 0,
                held.held_salt.hex() if held.held_salt is not None else "",
                now + held.lease_expires_in_s,
                held.held_prompt_mark or "",
            ]
        keys = (self._key(key), self._live, self._seen, index_key)
        raw = await self._call("record", self._record, keys, args)
        kept = bool(int(raw[0]))
        replaced = (_text(raw[1]), _text(raw[2])) if len(raw) == 3 else None
        return Recorded(kept, replaced)

    async def lookup(self, key: str) -> Conversation | None:
        keys = (self._key(key), self._seen)
        raw = await self._call("lookup", self._lookup, keys, (self.clock(), self.ttl_ms))
        return _conversation(key, _pairs(raw)) if raw else None

    async def snapshot(self, key: str) -> Conversation | None:
        try:
            raw = await self._client.hgetall(self._key(key))
        except self._redis.errors as error:
            raise self._redis.failed("snapshot", error) from None
        self._redis.succeeded()
        if not raw:
            return None
        return _conversation(key, {_text(k): _text(v) for k, v in raw.items()})

    async def renewed(self, key: str, request_id: str, expires_in_s: float | None) -> float:
        expires = "" if expires_in_s is None else self.clock() + expires_in_s
        keys = (self._key(key), self._live)
        renewed = await self._call(
            "renewed", self._renewed, keys, (request_id, expires, self.ttl_ms)
        )
        return max(0.0, expires_in_s or 0.0) if renewed else 0.0

    async def remove(self, key: str) -> Conversation | None:
        keys = (self._key(key), self._live, self._seen)
        raw = await self._call("remove", self._remove, keys, ())
        return _conversation(key, _pairs(raw)) if raw else None

    async def counts(self) -> tuple[int, int]:
        now = self.clock()
        idle_since = now - self.ttl_ms / 1000
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                # Entries that expired by themselves leave their index members behind.
                pipe.zremrangebyscore(self._seen, "-inf", idle_since)
                pipe.zremrangebyscore(self._live, "-inf", idle_since)
                pipe.zcard(self._seen)
                pipe.zcount(self._live, now, "+inf")
                *_, entries, live = await pipe.execute()
        except self._redis.errors as error:
            raise self._redis.failed("counts", error) from None
        self._redis.succeeded()
        return int(entries), int(live)

    def sweep(self, idle_s: float, budget: int) -> int:
        return 0  # every entry expires by itself in Redis


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(raw: Sequence[Any]) -> dict[str, str]:
    items = [_text(v) for v in raw]
    return dict(zip(items[::2], items[1::2], strict=True))


def _conversation(key: str, fields: dict[str, str]) -> Conversation:
    """An entry as Redis holds it, as a :class:`Conversation` (a snapshot)."""
    holder = fields.get("holder") or None
    digest = fields.get("digest") or None
    salt = fields.get("salt") or None
    return Conversation(
        key,
        fields.get("cid") or key,
        holder_url=holder,
        holder_request_id=fields.get("rid") or None,
        held_tokens=int(fields.get("held") or 0),
        held_digest=digest,
        held_digest_tokens=int(fields.get("dtok") or 0) if digest else 0,
        held_salt=bytes.fromhex(salt) if salt else None,
        held_prompt_mark=fields.get("mark") or None,
        lease_expires_at=float(fields.get("expires") or 0.0) if holder else 0.0,
        turns=int(fields.get("turns") or 0),
        recorded_turn=int(fields.get("recorded") or 0),
        epoch=int(fields.get("epoch") or 0),
        last_turn_id=fields.get("turn_id") or None,
        retries=int(fields.get("retries") or 0),
        heartbeats=int(fields.get("heartbeats") or 0),
        last_seen=float(fields.get("seen") or 0.0),
        settling_turn=int(fields.get("settling") or 0),
    )
