"""The implicit conversations' index: digest of a recent turn's messages plus its reply → the
conversation that turn belonged to (how a client that sends no conversation id has its next
turn found; the digests are :mod:`kvturn.gateway.digests`').

Memory is bounded: one entry per recent turn, least recently used dropped first.

An entry says more than whose turn it was (:class:`Indexed`): the turn's number, where its KV
was left and the digest of its prompt's verified prefix. A request that extends an *older* turn
of a conversation (a fork, a subagent started from the parent's context, a parallel call) is
planned against that KV without taking it from the conversation (:mod:`kvturn.gateway.turns.reuse`).
Every turn with chat messages is indexed, with a conversation id or without.

With ``--state redis://…`` the index lives in Redis beside the conversation table
(:class:`RedisImplicitIndex`), so a turn finds its conversation whichever gateway worker or
replica served the previous one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from kvturn.gateway.state.redis_client import RedisState


@dataclass(frozen=True, slots=True)
class Indexed:
    """What the index knows of a recent turn, found by its messages plus reply."""

    #: The conversation: its key in the table, its id.
    key: str
    conversation_id: str
    #: The turn's number in the conversation (0: not known, an entry written before numbers).
    turn: int = 0
    #: The decode that kept the turn's KV, and the digest of its prompt's verified prefix and
    #: the tokens that covers (:class:`~.table.Held`); empty while the reply is under way.
    holder_url: str | None = None
    digest: str | None = None
    digest_tokens: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(
            [
                self.key,
                self.conversation_id,
                self.turn,
                self.holder_url,
                self.digest,
                self.digest_tokens,
            ]
        )

    @classmethod
    def decode(cls, value: Any) -> Indexed:
        """From :meth:`encode` (or an older ``[key, id]`` value)."""
        items = list(orjson.loads(value))
        key, conversation_id = str(items[0]), str(items[1])
        if len(items) < 6:
            return cls(key, conversation_id)
        turn, holder, digest, tokens = items[2:6]
        return cls(
            key,
            conversation_id,
            int(turn or 0),
            str(holder) if holder else None,
            str(digest) if digest else None,
            int(tokens or 0) if digest else 0,
        )


class Index(Protocol):
    """Digest of a recent turn's messages plus reply → what is known of that turn
    (:class:`Indexed`). Written by the table, with the turn's record or mark (the
    ``findable`` of :meth:`~.table.ConversationTable.record`), so that a conversation is
    indexed only where its entry exists."""

    async def match(self, digests: Sequence[bytes]) -> Indexed | None:
        """The recorded turn that the longest prefix of ``digests`` ends."""
        ...

    def size(self) -> int | None:
        """Turns remembered (``None``: not counted here)."""
        ...


class ImplicitIndex:
    """In this process, LRU-bounded."""

    def __init__(self, max_entries: int):
        self._items: OrderedDict[bytes, Indexed] = OrderedDict()
        self._max = max_entries

    async def match(self, digests: Sequence[bytes]) -> Indexed | None:
        """The recorded turn that the longest prefix of ``digests`` ends."""
        for digest in reversed(digests):
            found = self._items.get(digest)
            if found is not None:
                self._items.move_to_end(digest)
                return found
        return None

    def put(self, digest: bytes, turn: Indexed) -> None:
        """Index ``turn`` under ``digest`` (the in-process table's record and mark)."""
        self._items[digest] = turn
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

    async def match(self, digests: Sequence[bytes]) -> Indexed | None:
        if not digests:
            return None
        try:
            found = await self._redis.client.mget([self.prefix + d.hex() for d in digests])
        except self._redis.errors as error:
            raise self._redis.failed("implicit_match", error) from None
        self._redis.succeeded()
        for value in reversed(found):
            if value is not None:
                return Indexed.decode(value)
        return None

    def item(self, digest: bytes, turn: Indexed) -> tuple[str, bytes]:
        """The key and value that index ``turn`` under ``digest`` (the table's record and
        mark set them, in their own scripts)."""
        return self.prefix + digest.hex(), turn.encode()

    def size(self) -> int | None:
        return None
