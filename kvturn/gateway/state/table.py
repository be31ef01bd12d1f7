"""The conversation table: conversation id → where its KV lives. Metadata only, bounded.

An entry holds a *reference* to the retained KV (the holder decode and the request id its
connector published it under), never block lists or digests: those stay on the decode and are
fetched when a turn reuses them, so an entry stays about 1 KB however long the history.

Two implementations behind one small interface (:class:`ConversationTable`):

- :class:`~.table_in_process.ConversationStore`, in this process (the default; nothing to
  install). LRU-bounded.
- :class:`~.table_redis.RedisConversations` (``--state redis://…``): shared by every worker and
  replica and kept across gateway restarts. Each entry is one Redis hash, kept ``idle_s`` after
  it was last written (Redis's own expiry replaces the in-process sweep).

What must be atomic across replicas is one Lua script each in Redis (and one step of the event
loop in process):

- :meth:`~ConversationTable.take`: a turn starts. The entry's retained KV comes off the table
  for this turn alone (decode frees retained blocks after one read, so two parallel turns on
  two replicas must never both pull them: the second finds nothing to take, and at most reads
  the KV on its decode, :mod:`kvturn.gateway.turns.sharing`), and the turn gets its sequence
  number.
- :meth:`~ConversationTable.record`: a turn's reply is over and its holder published the KV.
  Recorded only if no newer turn of the conversation recorded already (fencing by sequence
  number) and the entry is the one the turn started in (not one released and made anew since);
  otherwise the caller frees the KV it holds. An older holder the record replaces is returned,
  for the caller to free.

A new conversation that nobody can name yet (an implicit one, :mod:`kvturn.gateway.digests`,
whose key the gateway just drew) takes nothing: its turn starts with :func:`fresh_turn`, no
call, and its first write (its reply's settling mark, or its record) makes the entry. A record
can also make the conversation findable by its messages in the same step (``findable``): with
Redis a new implicit conversation's non-streamed turn is one round trip, not three.

A Redis that cannot be reached raises :class:`~kvturn.gateway.errors.StateUnavailable`; the
turn path treats that as "nothing known" and recomputes (see :mod:`kvturn.gateway.turns`), so
no turn fails because Redis is down, and reuse resumes with the first turn recorded after it is
back.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvturn.gateway.state.implicit import Index, Indexed


@dataclass(slots=True)
class Conversation:
    #: Its key in the table and on decode: the id scoped to the caller's tenant.
    key: str
    #: The id as the client gave it.
    conversation_id: str
    #: URL of the decode engine that holds the KV of the last turn, if any.
    holder_url: str | None = None
    #: The X-Request-Id under which the holder published the retained KV.
    holder_request_id: str | None = None
    #: Tokens whose KV the holder retains (prompt and generated).
    held_tokens: int = 0
    #: The last of the holder's chained prefix digests (:func:`kvturn.wire.prefix_digests`)
    #: and the tokens it covers: what a new prompt must start with for the holder's prefix
    #: cache to serve it whole. 24 hex characters, not the digest list.
    held_digest: str | None = None
    held_digest_tokens: int = 0
    #: A digest of the ``cache_salt`` the held KV was computed under (vLLM shares no KV
    #: between differently salted requests; neither does kvturn).
    held_salt: bytes | None = None
    #: What the held turn's request is recognised by (:func:`~.extension.prompt_mark`): a
    #: next request that extends it is planned without counting its tokens.
    held_prompt_mark: str | None = None
    #: When the holder's lease on the blocks lapses unless a turn or heartbeat renews it
    #: (the table's clock; the holder's connector is the truth, this is its last answer).
    lease_expires_at: float = 0.0
    #: Turns begun (each turn's sequence number), and the newest one whose KV was recorded.
    turns: int = 0
    recorded_turn: int = 0
    #: Made anew with the entry: a turn begun before a release records nothing after it.
    epoch: int = field(default_factory=lambda: int.from_bytes(os.urandom(7)))
    #: The client's id of the last turn (``X-Kvturn-Turn-Id``): a repeat is an SDK retry.
    last_turn_id: str | None = None
    retries: int = 0
    heartbeats: int = 0
    last_seen: float = 0.0
    #: The turn whose reply is under way and not yet recorded (0: none).
    settling_turn: int = 0
    #: In process: set when that turn is recorded (next turns wait on it).
    settling: asyncio.Event | None = field(default=None, repr=False, compare=False)

    def has_live_kv(self, now: float, margin_s: float) -> bool:
        """Whether the holder still leases the KV (by the gateway's last word from it)."""
        return self.holder_url is not None and now + margin_s < self.lease_expires_at


@dataclass(frozen=True, slots=True)
class Taken:
    """A turn's start: the conversation as it was when the turn took its KV off the table."""

    #: Its ``last_seen`` is from before this take: when the previous turn recorded its KV (or a
    #: heartbeat last came), so the gap since then is the client's pause.
    conversation: Conversation
    #: The turn's sequence number in the conversation (the fence its record passes).
    turn: int
    #: Whether the client's turn id repeats the previous turn's (an SDK retry).
    retry: bool
    #: The entry is not in the table yet (:func:`fresh_turn`): the turn's first write makes it.
    fresh: bool = False
    #: Nothing was taken: the conversation recorded a turn newer than the one the request
    #: extends (``after_turn`` of :meth:`ConversationTable.take`); the entry as it is.
    moved_on: bool = False


def fresh_turn(key: str, conversation_id: str) -> Taken:
    """Turn 1 of a conversation whose key was just drawn, so that no table holds it and no
    other turn can name it: there is nothing to take, and no call is made."""
    return Taken(Conversation(key, conversation_id, turns=1), 1, False, fresh=True)


@dataclass(frozen=True, slots=True)
class Held:
    """What a turn leaves on its holder, as the holder published it."""

    holder_url: str
    request_id: str
    held_tokens: int
    lease_expires_in_s: float
    held_digest: str | None = None
    held_digest_tokens: int = 0
    held_salt: bytes | None = None
    held_prompt_mark: str | None = None


@dataclass(frozen=True, slots=True)
class Recorded:
    """A record's outcome: whether it was kept, and the older holder it replaced, if any
    (``(holder_url, request_id)``: nobody will come back for that KV)."""

    kept: bool
    replaced: tuple[str, str] | None = None


class ConversationTable(Protocol):
    """Where every gateway worker and replica finds a conversation's KV (see module doc)."""

    #: The table's clock: ``lease_expires_at`` is on it.
    clock: Callable[[], float]

    async def take(
        self,
        key: str,
        conversation_id: str,
        turn_id: str | None,
        wait_s: float = 0.0,
        after_turn: int | None = None,
    ) -> Taken:
        """Start a turn (making the entry if there is none); its KV comes off the table. While
        the previous turn's KV location is being recorded, wait for it first (up to
        ``wait_s``: a record that never comes, from a gateway that died, is not waited for).
        ``after_turn``: the request extends that turn; if the conversation has recorded a
        newer one since, take nothing (:attr:`Taken.moved_on`: a fork, not a next turn)."""
        ...

    @property
    def implicit(self) -> Index:
        """The implicit conversations' index (:mod:`.implicit`), kept where the table is."""
        ...

    @property
    def reachable(self) -> bool:
        """Whether the table answered its last call (a turn that could skip its call,
        :func:`fresh_turn`, makes it while not: that is how the table is found back)."""
        ...

    def settling(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None = None,
        findable: tuple[bytes, Indexed] | None = None,
    ) -> Awaitable[None] | None:
        """The turn's reply is under way: next turns wait for its record a while. Done at
        once, or under way (the awaitable) where it needs a round trip. ``fresh`` and
        ``findable`` as for :meth:`record`: the mark can be a turn's first write."""

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
        """The turn is over: ``held`` is where its KV now lives (``None``: nowhere).
        ``fresh``: the entry a :func:`fresh_turn` started, made now if there is none (its
        first write). ``findable``: a digest of the turn's messages and reply, and the
        conversation (key, id) to index under it (the table's :attr:`implicit` index), in the
        same step, if its entry exists."""
        ...

    async def lookup(self, key: str) -> Conversation | None:
        """The entry as it is (a heartbeat; counted as one)."""
        ...

    async def snapshot(self, key: str) -> Conversation | None:
        """The entry as it is, read only: nothing counted, taken or kept alive (a fork reads
        where another conversation's KV lives)."""
        ...

    async def renewed(self, key: str, request_id: str, expires_in_s: float | None) -> float:
        """The holder's answer to a heartbeat for ``request_id``'s lease (``None``: it has no
        lease any more); the seconds the lease now has left."""
        ...

    async def remove(self, key: str) -> Conversation | None:
        """Release: the entry, gone from the table."""
        ...

    async def counts(self) -> tuple[int, int]:
        """Conversations in the table, and those whose lease has not lapsed (for a scrape)."""
        ...

    def sweep(self, idle_s: float, budget: int) -> int:
        """Forget idle entries, at most ``budget`` (bounded work); how many were forgotten."""
        ...
