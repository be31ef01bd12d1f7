"""The conversation table: conversation id → where its KV lives. Metadata only, bounded.

An entry holds a *reference* to the retained KV (the holder decode and the request id its
connector published it under), never block lists or digests: those stay on the decode and are
fetched when a turn reuses them, so an entry stays well under 1 KB however long the history.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


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
    #: The last of the holder's chained prefix digests (:func:`kvturn.kv_params.prefix_digests`)
    #: and the tokens it covers: what a new prompt must start with for the holder's prefix
    #: cache to serve it whole. 24 hex characters, not the digest list.
    held_digest: str | None = None
    held_digest_tokens: int = 0
    #: A digest of the ``cache_salt`` the held KV was computed under (vLLM shares no KV
    #: between differently salted requests; neither does kvturn).
    held_salt: bytes | None = None
    #: When the holder's lease on the blocks lapses unless a turn or heartbeat renews it
    #: (gateway clock; the holder's connector is the truth, this is its last answer).
    lease_expires_at: float = 0.0
    turns: int = 0
    #: The client's id of the last turn (``X-Kvturn-Turn-Id``): a repeat is an SDK retry.
    last_turn_id: str | None = None
    retries: int = 0
    heartbeats: int = 0
    last_seen: float = 0.0
    #: Set while the previous turn's retained-KV lookup is still running.
    settling: asyncio.Event | None = field(default=None, repr=False)

    def has_live_kv(self, now: float, margin_s: float) -> bool:
        """Whether the holder still leases the KV (by the gateway's last word from it)."""
        return self.holder_url is not None and now + margin_s < self.lease_expires_at


class ConversationStore:
    """LRU-bounded map of live conversations, on an injectable monotonic clock."""

    def __init__(self, max_conversations: int, clock: Callable[[], float] = time.monotonic):
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._max = max_conversations
        self.clock = clock

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

    def remove(self, key: str) -> Conversation | None:
        return self._items.pop(key, None)

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
    ) -> None:
        """The holder decode now leases ``held_tokens`` of this conversation's KV."""
        now = self.clock()
        conversation.holder_url = holder_url
        conversation.holder_request_id = request_id
        conversation.held_tokens = held_tokens
        conversation.held_digest = held_digest
        conversation.held_digest_tokens = held_digest_tokens if held_digest else 0
        conversation.held_salt = held_salt
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
        conversation.lease_expires_at = 0.0

    def renewed(self, conversation: Conversation, expires_in_s: float | None) -> float:
        """A heartbeat's renewal as the holder answered it (``None``: the holder has no lease
        any more); returns the seconds the lease now has left."""
        now = self.clock()
        conversation.heartbeats += 1
        conversation.last_seen = now
        if expires_in_s is None:
            self.forget_kv(conversation)
            return 0.0
        conversation.lease_expires_at = now + expires_in_s
        return max(0.0, expires_in_s)

    def sweep(self, idle_s: float, budget: int) -> int:
        """Forget, least recently used first, entries with no live KV that nothing has touched
        for ``idle_s``; stop at the first entry that must stay, or after ``budget`` entries
        (bounded work, whatever the table's size). Returns how many were forgotten."""
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

    async def live_count(self, chunk: int = 10_000) -> int:
        """Conversations whose lease has not lapsed, for a scrape: O(table), so it lets turns
        run every ``chunk`` entries instead of stalling them for the whole table (about 0.6 s
        at a million)."""
        now = self.clock()
        entries = list(self._items.values())
        live = 0
        for start in range(0, len(entries), chunk):
            live += sum(1 for c in entries[start : start + chunk] if c.lease_expires_at > now)
            await asyncio.sleep(0)
        return live

    def __len__(self) -> int:
        return len(self._items)


def salt_digest(cache_salt: object) -> bytes | None:
    """What a conversation keeps of a request's ``cache_salt``: 8 bytes, or ``None``."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(str(cache_salt).encode(), digest_size=8).digest()
