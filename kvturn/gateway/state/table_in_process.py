"""The conversation table in this process (the default; nothing to install): an LRU-bounded
map, every step of which runs in one step of the event loop (see :mod:`.table` for what must
be atomic)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable

from kvturn.gateway.state.implicit import ImplicitIndex, Indexed
from kvturn.gateway.state.table import Conversation, Held, Recorded, Taken


class ConversationStore:
    """In this process: an LRU-bounded map of live conversations, on an injectable
    monotonic clock. Every method runs in one step of the event loop: atomic by itself."""

    def __init__(self, max_conversations: int, clock: Callable[[], float] = time.monotonic):
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._max = max_conversations
        self.clock = clock
        self.implicit: ImplicitIndex = ImplicitIndex(max_conversations)
        #: Leases by when they lapse, so that a scrape counts the live ones in amortised O(1),
        #: whatever the table's size: each entry's current expiry, and a heap of every expiry
        #: set (stale ones are skipped as they come off it).
        self._expiry: dict[str, float] = {}
        self._lapsing: list[tuple[float, str]] = []

    # ---- the table interface ----------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        return True

    async def take(
        self,
        key: str,
        conversation_id: str,
        turn_id: str | None,
        wait_s: float = 0.0,
        after_turn: int | None = None,
    ) -> Taken:
        found = self._items.get(key)
        event = found.settling if found is not None else None
        if event is not None and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), wait_s)
        found = self._items.get(key)
        if after_turn is not None and found is not None and found.recorded_turn > after_turn:
            return Taken(dataclasses.replace(found, settling=None), 0, False, moved_on=True)
        seen_before = found.last_seen if found is not None else 0.0
        conversation = self.get_or_create(key, conversation_id)
        retry = self.note_turn(conversation, turn_id)
        conversation.turns += 1
        taken = dataclasses.replace(conversation, settling=None, last_seen=seen_before)
        self.forget_kv(conversation)
        return Taken(taken, conversation.turns, retry)

    def settling(
        self,
        key: str,
        turn: int,
        fresh: Conversation | None = None,
        findable: tuple[bytes, Indexed] | None = None,
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
        findable: tuple[bytes, Indexed] | None = None,
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

    async def snapshot(self, key: str) -> Conversation | None:
        conversation = self._items.get(key)
        return None if conversation is None else dataclasses.replace(conversation, settling=None)

    async def renewed(self, key: str, request_id: str, expires_in_s: float | None) -> float:
        conversation = self._items.get(key)
        if conversation is None or conversation.holder_request_id != request_id:
            return 0.0  # a turn took (or a release freed) that lease meanwhile
        return self.renew(conversation, expires_in_s)

    async def remove(self, key: str) -> Conversation | None:
        self._forget(key)
        return self._items.pop(key, None)

    async def counts(self) -> tuple[int, int]:
        return len(self._items), self.live_count()

    def live_count(self) -> int:
        """Entries whose lease has not lapsed: those lapsed since the last count come off the
        heap (amortised O(1) a change; a scrape once took O(table), 0.35 s at 100k)."""
        now = self.clock()
        lapsing, expiry = self._lapsing, self._expiry
        while lapsing and lapsing[0][0] <= now:
            at, key = heapq.heappop(lapsing)
            if expiry.get(key) == at:
                del expiry[key]
        return len(expiry)

    def _expires(self, conversation: Conversation, at: float) -> None:
        """Set when ``conversation``'s lease lapses (0: it has none), and track it."""
        conversation.lease_expires_at = at
        if at > 0:
            self._expiry[conversation.key] = at
            heapq.heappush(self._lapsing, (at, conversation.key))
            if len(self._lapsing) > 2 * len(self._expiry) + 1024:
                # Renewals leave stale expiries behind: rebuilt, the heap stays O(live).
                self._lapsing = [(t, k) for k, t in self._expiry.items()]
                heapq.heapify(self._lapsing)
        else:
            self._expiry.pop(conversation.key, None)

    def _forget(self, key: str) -> None:
        """An entry left the table (released, evicted or swept)."""
        self._expiry.pop(key, None)

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
            self._forget(self._items.popitem(last=False)[0])
            forgotten += 1
        return forgotten

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
        findable: tuple[bytes, Indexed] | None,
    ) -> Conversation | None:
        """The entry a write (a mark or a record) goes to: for ``fresh``, the one a
        :func:`~.table.fresh_turn` started, made if there is none; indexed by ``findable`` if it
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
                self._forget(self._items.popitem(last=False)[0])
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
        self._expires(conversation, now + lease_expires_in_s)
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
        self._expires(conversation, 0.0)

    def renew(self, conversation: Conversation, expires_in_s: float | None) -> float:
        """A heartbeat's renewal as the holder answered it (``None``: the holder has no lease
        any more); returns the seconds the lease now has left."""
        now = self.clock()
        conversation.last_seen = now
        if expires_in_s is None:
            self.forget_kv(conversation)
            return 0.0
        self._expires(conversation, now + expires_in_s)
        return max(0.0, expires_in_s)

    def __len__(self) -> int:
        return len(self._items)
