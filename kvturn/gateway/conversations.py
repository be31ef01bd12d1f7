"""The conversation table: conversation id → where its KV lives. Metadata only, bounded.

An entry holds a *reference* to the retained KV (the holder decode and the request id its
connector published it under), never block lists or digests: those stay on the decode and are
fetched when a turn reuses them, so an entry stays about 1 KB however long the history.

Two implementations behind one small interface (:class:`ConversationTable`):

- :class:`ConversationStore`, in this process (the default; nothing to install). LRU-bounded.
- :class:`RedisConversations` (``--state redis://…``): shared by every worker and replica and
  kept across gateway restarts. Each entry is one Redis hash, kept ``idle_s`` after it was last
  written (Redis's own expiry replaces the in-process sweep).

What must be atomic across replicas is one Lua script each in Redis (and one step of the event
loop in process):

- :meth:`~ConversationTable.take`: a turn starts. The entry's retained KV comes off the table
  for this turn alone (decode frees retained blocks after one read, so two parallel turns on
  two replicas must never both pull them: the second finds nothing and recomputes), and the
  turn gets its sequence number.
- :meth:`~ConversationTable.record`: a turn's reply is over and its holder published the KV.
  Recorded only if no newer turn of the conversation recorded already (fencing by sequence
  number) and the entry is the one the turn started in (not one released and made anew since);
  otherwise the caller frees the KV it holds. An older holder the record replaces is returned,
  for the caller to free.

A new conversation that nobody can name yet (an implicit one, :mod:`.implicit`, whose key the
gateway just drew) takes nothing: its turn starts with :func:`fresh_turn`, no call, and its
first write (its reply's settling mark, or its record) makes the entry. A record can also make
the conversation findable by its messages in the same step (``findable``): with Redis a new
implicit conversation's non-streamed turn is one round trip, not three.

A Redis that cannot be reached raises :class:`~.response_store.StateUnavailable`; the turn
path treats that as "nothing known" and recomputes (see :mod:`.turns`), so no turn fails
because Redis is down, and reuse resumes with the first turn recorded after it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvturn.gateway.implicit import ImplicitIndex, Index, RedisImplicitIndex
from kvturn.gateway.response_store import StateUnavailable, uses_redis

logger = logging.getLogger("kvturn.gateway.state")


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

    conversation: Conversation
    #: The turn's sequence number in the conversation (the fence its record passes).
    turn: int
    #: Whether the client's turn id repeats the previous turn's (an SDK retry).
    retry: bool
    #: The entry is not in the table yet (:func:`fresh_turn`): the turn's first write makes it.
    fresh: bool = False


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
        self, key: str, conversation_id: str, turn_id: str | None, wait_s: float = 0.0
    ) -> Taken:
        """Start a turn (making the entry if there is none); its KV comes off the table. While
        the previous turn's KV location is being recorded, wait for it first (up to
        ``wait_s``: a record that never comes, from a gateway that died, is not waited for)."""
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
        findable: tuple[bytes, tuple[str, str]] | None = None,
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
        findable: tuple[bytes, tuple[str, str]] | None = None,
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

    async def close(self) -> None: ...


class ConversationStore:
    """In this process: an LRU-bounded map of live conversations, on an injectable
    monotonic clock. Every method runs in one step of the event loop: atomic by itself."""

    def __init__(self, max_conversations: int, clock: Callable[[], float] = time.monotonic):
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._max = max_conversations
        self.clock = clock
        self.implicit: ImplicitIndex = ImplicitIndex(max_conversations)

    # ---- the table interface ----------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        return True

    async def take(
        self, key: str, conversation_id: str, turn_id: str | None, wait_s: float = 0.0
    ) -> Taken:
        found = self._items.get(key)
        event = found.settling if found is not None else None
        if event is not None and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), wait_s)
        conversation = self.get_or_create(key, conversation_id)
        retry = self.note_turn(conversation, turn_id)
        conversation.turns += 1
        taken = dataclasses.replace(conversation, settling=None)
        self.forget_kv(conversation)
        return Taken(taken, conversation.turns, retry)

    def settling(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None = None,
        findable: tuple[bytes, tuple[str, str]] | None = None,
    ) -> None:
        conversation = self._written(key, turn, fresh, findable)
        if conversation is not None and conversation.recorded_turn < turn:
            if conversation.settling is not None:
                conversation.settling.set()  # an earlier turn's waiters go on
            conversation.settling_turn = turn
            conversation.settling = asyncio.Event()

    async def record(
        self,
        key: str,
        epoch: int,
        turn: int,
        held: Held | None,
        *,
        fresh: Conversation | None = None,
        findable: tuple[bytes, tuple[str, str]] | None = None,
    ) -> Recorded:
        conversation = self._written(key, turn, fresh, findable)
        if conversation is None or conversation.epoch != epoch:
            return Recorded(held is None)
        if conversation.settling_turn and conversation.settling_turn <= turn:
            conversation.settling_turn = 0
            if conversation.settling is not None:
                conversation.settling.set()
                conversation.settling = None
        if held is None:
            return Recorded(True)
        if conversation.recorded_turn > turn:
            return Recorded(False)
        replaced = None
        if conversation.holder_url is not None and conversation.holder_request_id:
            replaced = (conversation.holder_url, conversation.holder_request_id)
        self.record_retained(
            conversation,
            held.holder_url,
            held.request_id,
            held.held_tokens,
            held.lease_expires_in_s,
            held.held_digest,
            held.held_digest_tokens,
            held.held_salt,
            held.held_prompt_mark,
        )
        conversation.recorded_turn = turn
        return Recorded(True, replaced)

    async def lookup(self, key: str) -> Conversation | None:
        conversation = self.get(key)
        if conversation is None:
            return None
        conversation.heartbeats += 1
        return dataclasses.replace(conversation, settling=None)

    async def renewed(self, key: str, request_id: str, expires_in_s: float | None) -> float:
        conversation = self._items.get(key)
        if conversation is None or conversation.holder_request_id != request_id:
            return 0.0  # a turn took (or a release freed) that lease meanwhile
        return self.renew(conversation, expires_in_s)

    async def remove(self, key: str) -> Conversation | None:
        return self._items.pop(key, None)

    async def counts(self) -> tuple[int, int]:
        return len(self._items), await self.live_count()

    async def live_count(self, chunk: int = 10_000) -> int:
        """O(table), so it lets turns run every ``chunk`` entries instead of stalling them for
        the whole table (about 0.6 s at a million)."""
        now = self.clock()
        entries = list(self._items.values())
        live = 0
        for start in range(0, len(entries), chunk):
            live += sum(1 for c in entries[start : start + chunk] if c.lease_expires_at > now)
            await asyncio.sleep(0)
        return live

    def sweep(self, idle_s: float, budget: int) -> int:
        """Forget, least recently used first, entries with no live KV that nothing has touched
        for ``idle_s``; stop at the first entry that must stay, or after ``budget`` entries
        (bounded work, whatever the table's size)."""
        now = self.clock()
        forgotten = 0
        while forgotten < budget and self._items:
            conversation = next(iter(self._items.values()))
            if (
                conversation.lease_expires_at > now
                or conversation.settling is not None
                or now - conversation.last_seen < idle_s
            ):
                break
            self._items.popitem(last=False)
            forgotten += 1
        return forgotten

    async def close(self) -> None:
        pass

    # ---- in-process access (the steps above, and tests) -------------------------------------

    def get(self, key: str) -> Conversation | None:
        """The entry, marked used now (a turn or a heartbeat)."""
        conversation = self._items.get(key)
        if conversation is not None:
            self._items.move_to_end(key)
            conversation.last_seen = self.clock()
        return conversation

    def peek(self, key: str) -> Conversation | None:
        """The entry, without marking it recently used."""
        return self._items.get(key)

    def _written(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None,
        findable: tuple[bytes, tuple[str, str]] | None,
    ) -> Conversation | None:
        """The entry a write (a mark or a record) goes to: for ``fresh``, the one a
        :func:`fresh_turn` started, made if there is none; indexed by ``findable`` if it
        exists (what the Redis scripts' ``make`` and ``index`` do)."""
        conversation = self._items.get(key)
        if conversation is None and fresh is not None:
            conversation = self.get_or_create(fresh.key, fresh.conversation_id)
            conversation.epoch = fresh.epoch
            conversation.turns = turn
        if findable is not None and conversation is not None:
            self.implicit.put(*findable)
        return conversation

    def get_or_create(self, key: str, conversation_id: str | None = None) -> Conversation:
        """The entry under ``key`` (tenant-scoped), made for ``conversation_id`` (the client's
        id; the key itself where there are no tenants) if there is none."""
        conversation = self.get(key)
        if conversation is None:
            conversation = Conversation(key, conversation_id or key, last_seen=self.clock())
            self._items[key] = conversation
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        return conversation

    def record_retained(
        self,
        conversation: Conversation,
        holder_url: str,
        request_id: str,
        held_tokens: int,
        lease_expires_in_s: float,
        held_digest: str | None = None,
        held_digest_tokens: int = 0,
        held_salt: bytes | None = None,
        held_prompt_mark: str | None = None,
    ) -> None:
        """The holder decode now leases ``held_tokens`` of this conversation's KV."""
        now = self.clock()
        conversation.holder_url = holder_url
        conversation.holder_request_id = request_id
        conversation.held_tokens = held_tokens
        conversation.held_digest = held_digest
        conversation.held_digest_tokens = held_digest_tokens if held_digest else 0
        conversation.held_salt = held_salt
        conversation.held_prompt_mark = held_prompt_mark
        conversation.lease_expires_at = now + lease_expires_in_s
        conversation.last_seen = now

    def note_turn(self, conversation: Conversation, turn_id: str | None) -> bool:
        """Record the client's turn id; whether this request retries the previous turn."""
        retry = turn_id is not None and turn_id == conversation.last_turn_id
        if retry:
            conversation.retries += 1
        conversation.last_turn_id = turn_id
        return retry

    def forget_kv(self, conversation: Conversation) -> None:
        conversation.holder_url = None
        conversation.holder_request_id = None
        conversation.held_tokens = 0
        conversation.held_digest = None
        conversation.held_digest_tokens = 0
        conversation.held_salt = None
        conversation.held_prompt_mark = None
        conversation.lease_expires_at = 0.0

    def renew(self, conversation: Conversation, expires_in_s: float | None) -> float:
        """A heartbeat's renewal as the holder answered it (``None``: the holder has no lease
        any more); returns the seconds the lease now has left."""
        now = self.clock()
        conversation.last_seen = now
        if expires_in_s is None:
            self.forget_kv(conversation)
            return 0.0
        conversation.lease_expires_at = now + expires_in_s
        return max(0.0, expires_in_s)

    def __len__(self) -> int:
        return len(self._items)


# ---- Redis ------------------------------------------------------------------------------------

#: Hash fields of a conversation's retained KV (what :meth:`take` clears).
_HELD_FIELDS = ("holder", "rid", "held", "digest", "dtok", "salt", "mark", "expires")

# KEYS: entry, live-lease index, entry index. ARGV: conversation id, turn id ('' none), now,
# ttl ms, epoch, settle window s ('': take whatever is under way). Returns the entry as it
# was, or {'settling', 1} (nothing changed) while a reply marked within the window records.
_TAKE = """
local h = KEYS[1]
if ARGV[6] ~= '' then
  local at = redis.call('HGET', h, 'settling_at')
  if at and tonumber(ARGV[3]) - tonumber(at) <= tonumber(ARGV[6]) then
    return {'settling', 1}
  end
end
if redis.call('EXISTS', h) == 0 then
  redis.call('HSET', h, 'cid', ARGV[1], 'epoch', ARGV[5], 'turns', 0, 'recorded', 0,
             'retries', 0, 'heartbeats', 0)
end
local retry = 0
local last = redis.call('HGET', h, 'turn_id')
if ARGV[2] ~= '' and last == ARGV[2] then
  retry = 1
  redis.call('HINCRBY', h, 'retries', 1)
end
redis.call('HSET', h, 'turn_id', ARGV[2], 'seen', ARGV[3])
local turn = redis.call('HINCRBY', h, 'turns', 1)
local entry = redis.call('HGETALL', h)
redis.call('HDEL', h, 'holder', 'rid', 'held', 'digest', 'dtok', 'salt', 'mark',
             'expires')
redis.call('PEXPIRE', h, ARGV[4])
redis.call('ZREM', KEYS[2], h)
redis.call('ZADD', KEYS[3], ARGV[3], h)
table.insert(entry, 'retry')
table.insert(entry, retry)
return entry
"""

# The writes below share these: make the entry a fresh turn started (its conversation id,
# '': not fresh), if there is none; index it by a turn's messages (the implicit index's key,
# '': none), if it exists.
_MAKE = """
local function make(h, seen, cid, epoch, turn, now, ttl)
  if cid ~= '' and redis.call('EXISTS', h) == 0 then
    redis.call('HSET', h, 'cid', cid, 'epoch', epoch, 'turns', turn, 'recorded', 0,
               'retries', 0, 'heartbeats', 0, 'seen', now)
    redis.call('PEXPIRE', h, ttl)
    redis.call('ZADD', seen, now, h)
  end
end
local function index(h, key, value, ttl)
  if key ~= '' and redis.call('EXISTS', h) == 1 then
    redis.call('SET', key, value, 'PX', ttl)
  end
end
"""

# KEYS: entry, entry index, implicit index key. ARGV: turn, now, ttl ms, a fresh turn's
# conversation id, its epoch, the implicit index's value.
_SETTLING = (
    _MAKE
    + """
local h = KEYS[1]
make(h, KEYS[2], ARGV[4], ARGV[5], ARGV[1], ARGV[2], ARGV[3])
index(h, KEYS[3], ARGV[6], ARGV[3])
local recorded = redis.call('HGET', h, 'recorded')
if recorded and tonumber(recorded) < tonumber(ARGV[1]) then
  redis.call('HSET', h, 'settling', ARGV[1], 'settling_at', ARGV[2])
end
return 0
"""
)

# KEYS: entry, live-lease index, entry index, implicit index key ('': none). ARGV: epoch,
# turn, ttl ms, now, a fresh turn's conversation id ('': not fresh), the implicit index's
# value, then (when something is held) holder, request id, tokens, digest, digest tokens,
# salt, expires at, prompt mark. Returns {kept (0/1), replaced holder, replaced request id}.
_RECORD = (
    _MAKE
    + """
local h = KEYS[1]
make(h, KEYS[3], ARGV[5], ARGV[1], ARGV[2], ARGV[4], ARGV[3])
index(h, KEYS[4], ARGV[6], ARGV[3])
local cur = redis.call('HMGET', h, 'epoch', 'recorded', 'holder', 'rid', 'settling')
if cur[1] ~= ARGV[1] then
  if #ARGV > 6 then return {0} end
  return {1}
end
local turn = tonumber(ARGV[2])
if cur[5] and tonumber(cur[5]) <= turn then
  redis.call('HDEL', h, 'settling', 'settling_at')
end
if #ARGV == 6 then return {1} end
if tonumber(cur[2]) > turn then return {0} end
redis.call('HSET', h, 'recorded', turn, 'holder', ARGV[7], 'rid', ARGV[8], 'held', ARGV[9],
           'digest', ARGV[10], 'dtok', ARGV[11], 'salt', ARGV[12], 'expires', ARGV[13],
           'mark', ARGV[14], 'seen', ARGV[4])
redis.call('PEXPIRE', h, ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[13], h)
if cur[3] and cur[4] and cur[4] ~= ARGV[8] then return {1, cur[3], cur[4]} end
return {1}
"""
)

# KEYS: entry, entry index. ARGV: now, ttl ms.
_LOOKUP = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {} end
redis.call('HINCRBY', h, 'heartbeats', 1)
redis.call('HSET', h, 'seen', ARGV[1])
redis.call('PEXPIRE', h, ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], h)
return redis.call('HGETALL', h)
"""

# KEYS: entry, live-lease index. ARGV: request id, expires at ('' : gone), ttl ms.
_RENEWED = """
local h = KEYS[1]
if redis.call('HGET', h, 'rid') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('HDEL', h, 'holder', 'rid', 'held', 'digest', 'dtok', 'salt', 'mark',
             'expires')
  redis.call('ZREM', KEYS[2], h)
  return 0
end
redis.call('HSET', h, 'expires', ARGV[2])
redis.call('PEXPIRE', h, ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], h)
return 1
"""

# KEYS: entry, live-lease index, entry index.
_REMOVE = """
local entry = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('ZREM', KEYS[3], KEYS[1])
return entry
"""


class RedisConversations:
    """The table in Redis (``redis://host:port/db``), shared by every worker and replica.

    One hash per conversation under ``{prefix}conv:{key}``, kept ``idle_s`` after its last
    write (a turn, a record, a heartbeat); a sorted set of lease expiries counts live leases
    without scanning. Times are wall-clock seconds (replicas on several hosts share them; keep
    their clocks in sync, as for any lease). Every operation is one round trip.
    """

    def __init__(
        self,
        url: str,
        idle_s: float,
        *,
        timeout_s: float = 0.5,
        prefix: str = "kvturn:",
        clock: Callable[[], float] = time.time,
        on_error: Callable[[str], None] | None = None,
        settle_poll_s: float = 0.005,
    ):
        # Imported here: only a gateway configured with Redis state needs the client.
        import redis.asyncio

        self._redis = redis.asyncio.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        #: What a failed Redis call raises.
        self.errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._down_since: float | None = None
        self.clock = clock
        self.ttl_ms = max(1, int(idle_s * 1000))
        self.prefix = prefix
        #: Sorted sets (member: entry key): lease expiry, and last use (what counts take).
        self._live = f"{prefix}live-leases"
        self._seen = f"{prefix}conversations"
        self.on_error = on_error or (lambda op: None)
        self.settle_poll_s = settle_poll_s
        self._take = self._redis.register_script(_TAKE)
        self._settling = self._redis.register_script(_SETTLING)
        self._record = self._redis.register_script(_RECORD)
        self._lookup = self._redis.register_script(_LOOKUP)
        self._renewed = self._redis.register_script(_RENEWED)
        self._remove = self._redis.register_script(_REMOVE)
        self.implicit = RedisImplicitIndex(self)

    def _key(self, key: str) -> str:
        return f"{self.prefix}conv:{key}"

    async def _call(self, op: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            result = await script(keys=list(keys), args=list(args))
        except self.errors as error:
            raise self.failed(op, error) from None
        self.succeeded()
        return result

    def failed(self, op: str, error: BaseException) -> StateUnavailable:
        """Count a failed call; log the outage once, as it starts. Returns what to raise."""
        self.on_error(op)
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "state store unreachable (%s: %s): turns recompute and keep no KV until it "
                "is back (kvturn_state_errors_total counts the failed calls)",
                op,
                error,
            )
        return StateUnavailable("the gateway's state store is unavailable")

    @property
    def reachable(self) -> bool:
        return self._down_since is None

    def succeeded(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "state store reachable again after %.1f s: reuse resumes",
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    async def take(
        self, key: str, conversation_id: str, turn_id: str | None, wait_s: float = 0.0
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
            args = (conversation_id, turn_id or "", self.clock(), self.ttl_ms, epoch, window)
            raw = await self._call("take", self._take, keys, args)
            if len(raw) != 2 or _text(raw[0]) != "settling":
                break
            await asyncio.sleep(self.settle_poll_s)
        fields = _pairs(raw)
        conversation = _conversation(key, fields)
        return Taken(conversation, conversation.turns, fields.get("retry") == "1")

    def settling(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None = None,
        findable: tuple[bytes, tuple[str, str]] | None = None,
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
        findable: tuple[bytes, tuple[str, str]] | None = None,
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
            async with self._redis.pipeline(transaction=False) as pipe:
                # Entries that expired by themselves leave their index members behind.
                pipe.zremrangebyscore(self._seen, "-inf", idle_since)
                pipe.zremrangebyscore(self._live, "-inf", idle_since)
                pipe.zcard(self._seen)
                pipe.zcount(self._live, now, "+inf")
                *_, entries, live = await pipe.execute()
        except self.errors as error:
            raise self.failed("counts", error) from None
        self.succeeded()
        return int(entries), int(live)

    def sweep(self, idle_s: float, budget: int) -> int:
        return 0  # every entry expires by itself in Redis

    @property
    def redis(self) -> Any:
        """The Redis client (the implicit-conversation index shares it)."""
        return self._redis

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except self.errors:
            return False

    async def close(self) -> None:
        await self._redis.aclose()


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


def conversation_table(
    url: str | None,
    max_conversations: int,
    idle_s: float,
    on_error: Callable[[str], None] | None = None,
    timeout_s: float = 0.5,
) -> ConversationTable:
    """The table a gateway's ``state`` setting names (:func:`~.response_store.uses_redis`)."""
    if uses_redis(url):
        assert url is not None
        return RedisConversations(url, idle_s, timeout_s=timeout_s, on_error=on_error)
    return ConversationStore(max_conversations)


def salt_digest(cache_salt: object) -> bytes | None:
    """What a conversation keeps of a request's ``cache_salt``: 8 bytes, or ``None``."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(str(cache_salt).encode(), digest_size=8).digest()
