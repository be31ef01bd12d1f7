"""Decode-side KV leases (plain Python, injected clock; no vLLM import).

A *lease* is a finished turn's KV blocks that a decode engine keeps for the conversation's next
turn. NixlConnector retains a finished decode request's blocks until a deadline and frees them
when a prefill has read them or the deadline passes; :class:`LeaseTable` decides those deadlines
per conversation:

* **retain**: a turn of a conversation finished; its lease runs ``lease_s`` (capped by
  ``max_lease_s``). A turn without a conversation is not leased at all (the connector frees its
  blocks at once). A newer turn of the same conversation supersedes the older lease.
* **renew**: a heartbeat extends a live lease (never a lapsed one) and says what kind of pause
  the conversation is in. A tool pause is extended for as long as beats come (the tool is
  running); a user pause no further than the length within which ``user_coverage`` (95 %) of
  users' pauses end, as learned: a client beats through a user's pause whether or not anyone
  is still reading, and one that has lasted past that is unlikely to end soon.
* **claim**: a prefill is about to read the lease; it cannot expire, be released or be
  reclaimed until the read ends (the blocks are single-use: the read frees them) or the claim
  times out.
* **release**: the conversation ended: free the blocks now (after the claim, if one runs).
* **reclaim**: decode's free KV blocks fell below the watermark: free leases in order of
  expected return (a user pause before a tool pause; within a kind, the one least likely to come
  back soon given how long it has been paused, under a per-kind lognormal learned online).

A lease's blocks stay ``guard_s`` past the moment the table stops honouring it (no renewal, no
claim): a renewal or claim granted just before the end reaches NIXL's worker (one engine step
later) well before the blocks' old deadline, so a prefill never reads blocks the worker freed.

The table never frees memory itself: :meth:`LeaseTable.take_deadlines` hands the connector the
new deadline of every lease that changed (a past deadline frees the blocks at once), and
:meth:`LeaseTable.finished` is told when the engine actually freed them. Times are this
process's clock; across processes only durations travel.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvturn.pauses import LogNormal
from kvturn.wire import EndReason, LeaseStats

# vLLM appends "-<8 hex>" to every request id, and prefixes chat ids with "chatcmpl-" and
# completion ids with "cmpl-"; a completion's id also carries its prompt's position ("-0").
# The gateway knows only the X-Request-Id it sent.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
_CHAT_PREFIX = "chatcmpl-"
_COMPLETION = re.compile(r"^cmpl-(.*)-\d+$")


def publication_key(engine_request_id: str) -> str:
    """The X-Request-Id part of an engine request id."""
    request_id = _RANDOM_SUFFIX.sub("", engine_request_id)
    completion = _COMPLETION.match(request_id)
    if completion is not None:
        return completion.group(1)
    return request_id.removeprefix(_CHAT_PREFIX)


#: Reclaim order of pause kinds: a user pause goes first, a tool pause last.
_KIND_RANK: dict[str, int] = {"user": 0, "unknown": 1, "tool": 2}


class PauseModel:
    """Online lognormal model of pause lengths, one per pause kind
    (:class:`~kvturn.pauses.LogNormal`).

    Each kind starts from a prior (weight ``prior_weight`` observations) and learns from every
    observed pause; an absurd report moves it as far as one unusual pause.
    """

    #: Prior medians (s) and log-space spreads: tools return in seconds, users in a minute.
    PRIORS: dict[str, tuple[float, float]] = {
        "tool": (2.0, 1.0),
        "user": (30.0, 1.2),
        "unknown": (10.0, 1.5),
    }

    def __init__(self, prior_weight: float = 5.0):
        self._kinds = {
            kind: LogNormal(median, sigma, prior_weight)
            for kind, (median, sigma) in self.PRIORS.items()
        }

    def observe(self, kind: str, seconds: float) -> None:
        if kind in self._kinds:
            self._kinds[kind].observe(seconds)

    def params(self, kind: str) -> tuple[float, float]:
        """``(mu, sigma)`` of ``log(seconds)`` for ``kind``."""
        model = self._kinds.get(kind, self._kinds["unknown"])
        return model.mu, model.sigma

    def return_probability(self, kind: str, paused_s: float, horizon_s: float) -> float:
        """P(the pause ends within ``horizon_s`` | it has lasted ``paused_s`` so far)."""
        model = self._kinds.get(kind, self._kinds["unknown"])
        return model.return_probability(paused_s, horizon_s)

    def quantile(self, kind: str, q: float) -> float:
        """The length within which a share ``q`` of ``kind``'s pauses end."""
        return self._kinds.get(kind, self._kinds["unknown"]).quantile(q)


@dataclass(slots=True)
class Lease:
    request_id: str
    #: The X-Request-Id the gateway sent: the name the lease goes by on the control channel.
    key: str
    conversation: str
    #: What a prefill needs to read the blocks (NIXL params, digests), as published.
    params: dict[str, Any]
    #: Block ids per KV cache group.
    block_ids: tuple[list[int], ...]
    expires_at: float
    paused_since: float
    pause_kind: str = "unknown"
    claimed_until: float = 0.0
    #: Set when the lease must go as soon as no claim holds it.
    ending: EndReason | None = None
    renewals: int = 0
    #: Whether memory pressure may take it (not for requests another proxy drives: upstream
    #: semantics, a fixed TTL and nothing else).
    reclaimable: bool = True

    @property
    def blocks(self) -> int:
        return max((len(group) for group in self.block_ids), default=0)


@dataclass(slots=True)
class LeaseCounters:
    retained: int = 0
    renewed: int = 0
    claimed: int = 0
    not_retained: int = 0
    ended: Counter[str] = field(default_factory=Counter)


def _bounded(lease_s: float, longest: float) -> float:
    """A lease's length as asked, within [0, ``longest``] (0 for nonsense)."""
    if not math.isfinite(lease_s) or lease_s < 0:
        lease_s = 0.0
    return min(lease_s, longest)


class LeaseTable:
    """All leases of one decode engine. Thread-safe (the control server's threads and the
    engine's scheduler thread share it)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        max_lease_s: float,
        claim_s: float = 30.0,
        reclaim_horizon_s: float = 10.0,
        guard_s: float = 2.0,
        pause_model: PauseModel | None = None,
        max_tombstones: int = 4096,
        user_coverage: float = 0.95,
    ):
        self.clock = clock
        self.max_lease_s = max_lease_s
        self.claim_s = claim_s
        self.reclaim_horizon_s = reclaim_horizon_s
        self.guard_s = guard_s
        self.pauses = pause_model or PauseModel()
        self.user_coverage = user_coverage
        self.counters = LeaseCounters()
        self._by_request: dict[str, Lease] = {}
        self._by_key: dict[str, Lease] = {}
        self._by_conversation: dict[str, Lease] = {}
        # request id -> new deadline, drained by the connector each engine step.
        self._deadlines: dict[str, float] = {}
        # Ended leases whose blocks wait for a claim (a prefill's read) to end.
        self._after_claim: list[Lease] = []
        # key -> why it ended, so a late claim can say why the KV is gone.
        self._tombstones: OrderedDict[str, EndReason] = OrderedDict()
        self._max_tombstones = max_tombstones
        self._lock = threading.Condition()
        #: Facts about the engine the gateway needs (block size, KV bytes per token), served
        #: with the stats.
        self.engine: dict[str, Any] = {}

    # ---- the engine's side ------------------------------------------------------------------

    def retain(
        self,
        request_id: str,
        key: str,
        conversation: str,
        params: dict[str, Any],
        block_ids: Sequence[Sequence[int]],
        lease_s: float,
        *,
        reclaimable: bool = True,
    ) -> Lease:
        """A finished turn of ``conversation`` keeps its blocks: lease them for ``lease_s``."""
        now = self.clock()
        lease = Lease(
            request_id=request_id,
            key=key,
            conversation=conversation,
            params=params,
            block_ids=tuple(list(group) for group in block_ids),
            expires_at=now + _bounded(lease_s, self.max_lease_s),
            paused_since=now,
            reclaimable=reclaimable,
        )
        with self._lock:
            previous = self._by_conversation.get(conversation)
            if previous is not None:
                self._end(previous, "superseded", now)
            self._by_request[request_id] = lease
            self._by_key[key] = lease
            self._by_conversation[conversation] = lease
            self._tombstones.pop(key, None)
            self._deadlines[request_id] = lease.expires_at + self.guard_s
            self.counters.retained += 1
            self._lock.notify_all()
        return lease

    def observe_pause(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.pauses.observe(kind, seconds)

    def take_deadlines(self) -> dict[str, float]:
        """Deadlines changed since the last call (request id → deadline on this clock; a past
        one frees the blocks now). Also ends released leases whose claim ran out unread."""
        with self._lock:
            if self._after_claim:
                now = self.clock()
                for lease in [x for x in self._after_claim if x.claimed_until <= now]:
                    self._after_claim.remove(lease)
                    if lease.request_id in self._by_request:
                        self._deadlines[lease.request_id] = now - 1.0
            deadlines, self._deadlines = self._deadlines, {}
            return deadlines

    def finished(self, request_id: str) -> EndReason | None:
        """The engine freed ``request_id``'s blocks (read by a prefill, or its deadline
        passed); why, or ``None`` if it was no lease."""
        with self._lock:
            lease = self._by_request.pop(request_id, None)
            if lease is None:
                return None
            if lease.ending is not None:
                reason: EndReason = lease.ending
            elif self.clock() >= lease.expires_at - 1e-3:
                reason = "expired"
            else:
                reason = "read"
            self._forget(lease, reason)
            return reason

    # ---- the gateway's side (control channel) -----------------------------------------------

    def get(self, key: str, wait_s: float = 0.0) -> Lease | None:
        """The live lease published under ``key``, waiting up to ``wait_s`` for it."""
        with self._lock:
            deadline = self.clock() + wait_s
            while True:
                lease = self._live(key)
                if lease is not None or key in self._tombstones:
                    return lease
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)

    def holds(self, conversation: str) -> bool:
        """Whether ``conversation`` has a live lease (its blocks are kept referenced)."""
        with self._lock:
            lease = self._by_conversation.get(conversation)
            return lease is not None and lease.ending is None and lease.expires_at > self.clock()

    def gone_reason(self, key: str) -> str:
        with self._lock:
            lease = self._by_key.get(key)
            if lease is not None and lease.ending is not None:
                return lease.ending
            if lease is not None and lease.expires_at <= self.clock():
                return "expired"
            return self._tombstones.get(key, "unknown")

    def renew(
        self, key: str, lease_s: float, pause_kind: str | None = None, paused_s: float | None = None
    ) -> Lease | None:
        """Extend a live lease to ``lease_s`` from now (never shorten it); ``None`` if none."""
        with self._lock:
            lease = self._live(key)
            if lease is None:
                return None
            now = self.clock()
            if pause_kind in _KIND_RANK:
                lease.pause_kind = pause_kind
            if paused_s is not None and math.isfinite(paused_s) and paused_s >= 0:
                lease.paused_since = min(lease.paused_since, now - paused_s)
            extended = now + _bounded(lease_s, self.max_lease_s)
            if lease.pause_kind == "user":
                # No further than most users' pauses last (from when this one began).
                longest = self.pauses.quantile("user", self.user_coverage)
                extended = min(extended, lease.paused_since + longest)
            expires_at = max(lease.expires_at, extended)
            if expires_at != lease.expires_at:
                lease.expires_at = expires_at
                self._deadlines[lease.request_id] = expires_at + self.guard_s
            lease.renewals += 1
            self.counters.renewed += 1
            return lease

    def claim(self, key: str) -> Lease | None:
        """A prefill is about to read the lease: hold it for :attr:`claim_s` (or until the
        read frees it). ``None`` if there is no live lease."""
        with self._lock:
            lease = self._live(key)
            if lease is None or lease.claimed_until > 0:
                # A lease is read once: a second claim would read freed blocks.
                return None
            now = self.clock()
            lease.claimed_until = now + self.claim_s
            if lease.expires_at < lease.claimed_until:
                lease.expires_at = lease.claimed_until
                self._deadlines[lease.request_id] = lease.expires_at + self.guard_s
            self.counters.claimed += 1
            return lease

    def release(self, key: str, end_claim: bool = False) -> bool:
        """Free the lease now, or once the claim on it ends (``end_claim``: the claimant says
        its read is over); whether there was a lease to release."""
        with self._lock:
            lease = self._by_key.get(key)
            if lease is None:
                return False
            now = self.clock()
            if end_claim:  # also of an ending lease (superseded while a local turn held it)
                lease.claimed_until = min(lease.claimed_until, now)
            if lease.ending is not None:
                return False
            self._end(lease, "released", now)
            return True

    # ---- memory pressure --------------------------------------------------------------------

    def reclaim(self, blocks_needed: int) -> list[Lease]:
        """Free leases, least likely to return soon first, until ``blocks_needed`` blocks are
        on their way back (claimed leases are never taken). Returns the leases taken."""
        if blocks_needed <= 0:
            return []
        with self._lock:
            now = self.clock()
            taken: list[Lease] = []
            freed = 0
            for lease in self._reclaim_candidates(now):
                if freed >= blocks_needed:
                    break
                self._end(lease, "reclaimed", now)
                taken.append(lease)
                freed += lease.blocks
            return taken

    def reclaim_order(self) -> list[str]:
        """Keys of reclaimable leases in the order :meth:`reclaim` would take them."""
        with self._lock:
            return [lease.key for lease in self._reclaim_candidates(self.clock())]

    def _reclaim_candidates(self, now: float) -> list[Lease]:
        """Leases pressure may take, least likely to return soon first (lock held)."""
        live = [
            lease
            for lease in self._by_request.values()
            if lease.reclaimable and lease.ending is None and lease.claimed_until <= now
        ]
        return sorted(live, key=lambda lease: self._keep_score(lease, now))

    def _keep_score(self, lease: Lease, now: float) -> tuple[int, float]:
        kind = lease.pause_kind
        chance = self.pauses.return_probability(
            kind, max(0.0, now - lease.paused_since), self.reclaim_horizon_s
        )
        return _KIND_RANK.get(kind, 1), chance

    # ---- reading ----------------------------------------------------------------------------

    def ending_blocks(self) -> int:
        """Blocks of leases already on their way to being freed."""
        with self._lock:
            return sum(lease.blocks for lease in self._by_request.values() if lease.ending)

    def stats(self) -> LeaseStats:
        with self._lock:
            now = self.clock()
            live = [
                lease
                for lease in self._by_request.values()
                if lease.ending is None and lease.expires_at > now
            ]
            return LeaseStats(
                leases=len(live),
                blocks_held=sum(lease.blocks for lease in self._by_request.values()),
                retained=self.counters.retained,
                not_retained=self.counters.not_retained,
                renewed=self.counters.renewed,
                claimed=self.counters.claimed,
                ended=dict(self.counters.ended),
                **self.engine,
            )

    def __len__(self) -> int:
        return self.stats().leases

    # ---- internals (lock held) --------------------------------------------------------------

    def _live(self, key: str) -> Lease | None:
        lease = self._by_key.get(key)
        if lease is None or lease.ending is not None or lease.expires_at <= self.clock():
            return None
        return lease

    def _end(self, lease: Lease, reason: EndReason, now: float) -> None:
        """Mark ``lease`` to be freed as soon as no claim holds it."""
        if lease.ending is not None:
            return
        lease.ending = reason
        if self._by_conversation.get(lease.conversation) is lease:
            del self._by_conversation[lease.conversation]
        if lease.claimed_until <= now:
            self._deadlines[lease.request_id] = now - 1.0
        else:
            self._after_claim.append(lease)

    def _forget(self, lease: Lease, reason: EndReason) -> None:
        self.counters.ended[reason] += 1
        if self._by_key.get(lease.key) is lease:
            del self._by_key[lease.key]
        if self._by_conversation.get(lease.conversation) is lease:
            del self._by_conversation[lease.conversation]
        self._tombstones[lease.key] = reason
        self._tombstones.move_to_end(lease.key)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
        self._lock.notify_all()
