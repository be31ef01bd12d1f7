"""The implicit conversations' index: digest of a recent turn's messages plus its reply → the
conversation that turn belonged to (how a client that sends no conversation id has its next
turn found; the digests are :mod:`kvturn.gateway.digests`').

Memory is bounded: one entry per recent turn, least recently used dropped first.

With ``--state redis://…`` the index lives in Redis beside the conversation table
(:class:`RedisImplicitIndex`), so a turn finds its conversation whichever gateway worker or
replica served the previous one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import orjson

from kvturn.gateway.state.redis_client import RedisState


class Index(Protocol):
    """Digest of a recent turn's messages plus reply → the conversation (its key in the
    table, its id). Written by the table, with the turn's record or mark (the ``findable``
    of :meth:`~.table.ConversationTable.record`), so that a conversation is indexed
    only where its entry exists."""

    async def match(self, digests: Sequence[bytes]) -> tuple[str, str] | None:
        """The conversation of the recorded turn that the longest prefix of ``digests`` ends."""
        ...

    def size(self) -> int | None:
        """Turns remembered (``None``: not counted here)."""
        ...


class ImplicitIndex:
    """In this process, LRU-bounded."""

    def __init__(self, max_entries: int):
        self._items: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self._max = max_entries

    async def match(self, digests: Sequence[bytes]) -> tuple[str, str] | None:
        """The conversation of the recorded turn that the longest prefix of ``digests`` ends."""
        for digest in reversed(digests):
            found = self._items.get(digest)
            if found is not None:
                self._items.move_to_end(digest)
                return found
        return None

    def put(self, digest: bytes, conversation: tuple[str, str]) -> None:
        """Index ``conversation`` under ``digest`` (the in-process table's record and mark)."""
        self._items[digest] = conversation
        self._items.move_to_end(digest)
        while len(self._items) > self._max:
            self._items.popitem(last=False)

    def size(self) -> int | None:
        return len(self._items)


class RedisImplicitIndex:
    """In Redis, beside the conversation table (:class:`~.table_redis.RedisConversations`,
    whose client, expiry and outage reporting it shares): one key per recorded turn
    (``{prefix}implicit:{digest}``), kept as long as a conversation's entry. One ``MGET`` per
    match."""

    def __init__(self, redis: RedisState):
        self._redis = redis
        self.prefix = f"{redis.prefix}implicit:"

    async def match(self, digests: Sequence[bytes]) -> tuple[str, str] | None:
        if not digests:
            return None
        try:
            found = await self._redis.client.mget([self.prefix + d.hex() for d in digests])
        except self._redis.errors as error:
            raise self._redis.failed("implicit_match", error) from None
        self._redis.succeeded()
        for value in reversed(found):
            if value is not None:
                key, conversation_id = orjson.loads(value)
                return str(key), str(conversation_id)
        return None

    def item(self, digest: bytes, conversation: tuple[str, str]) -> tuple[str, bytes]:
        """The key and value that index ``conversation`` under ``digest`` (the table's record
        and mark set them, in their own scripts)."""
        return self.prefix + digest.hex(), orjson.dumps(list(conversation))

    def size(self) -> int | None:
        return None
