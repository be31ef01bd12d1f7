"""What one caller may hold of the gateway at once (issue #39): its requests in flight on the
turn routes, and the engine requests they make. A caller is a tenant: an API key's, or, on an
open gateway, every caller together (the tenant ``""``).

Both are counted in this process (each of ``kvturn serve --workers N`` counts its own) from
the moment a request is admitted until its reply is whole: a streamed reply until its stream
ended or its client left. Past either bound a request is refused at once, before it reaches
an engine or the conversation table, with a 429 and ``Retry-After``
(:data:`~.errors.RETRY_AFTER_S`); nothing is held for it. A batch of prompts needs one
engine request per prompt (:mod:`.batches`): it runs through a window of at most
:data:`~.batches.BATCH_WINDOW` of them, fewer where its tenant has fewer left, and is refused
only where it has none left.
"""

from __future__ import annotations

from kvturn.gateway.errors import TooManyRequests


class CallerLimits:
    """Requests and engine requests in flight, by tenant, each bounded (0: no bound)."""

    def __init__(self, requests: int, engine_requests: int):
        #: Requests one tenant may have in flight on the turn routes at once.
        self.max_requests = requests
        #: Engine requests one tenant's requests may have in flight at once.
        self.max_engine_requests = engine_requests
        self.requests: dict[str, int] = {}
        self.engine_requests: dict[str, int] = {}
        #: Requests in flight, every tenant's, and of them the batches of prompts: the
        #: others are the turns batches yield to (:class:`~.congestion.BulkLane`).
        self.in_flight = 0
        self.batches = 0

    @property
    def turns_in_flight(self) -> int:
        """Requests in flight that are not batches of prompts."""
        return self.in_flight - self.batches

    def admit(self, tenant: str) -> Admission:
        """Count a request of ``tenant`` in flight, holding one engine request for it;
        :class:`~.errors.TooManyRequests` (nothing counted) past either bound."""
        held = self.requests.get(tenant, 0)
        if self.max_requests and held >= self.max_requests:
            raise TooManyRequests(
                f"this tenant already has {held} requests in flight, the most the gateway "
                "serves for one tenant at once; retry shortly"
            )
        engines = self.engine_requests.get(tenant, 0)
        if self.max_engine_requests and engines >= self.max_engine_requests:
            raise TooManyRequests(
                f"this tenant's requests already hold {engines} engine requests, the most the "
                "gateway opens for one tenant at once; retry shortly"
            )
        self.requests[tenant] = held + 1
        self.engine_requests[tenant] = engines + 1
        self.in_flight += 1
        return Admission(self, tenant)

    def _give_back(self, tenant: str, engine_requests: int, batch: bool) -> None:
        _decrease(self.requests, tenant, 1)
        _decrease(self.engine_requests, tenant, engine_requests)
        self.in_flight -= 1
        self.batches -= batch


class Admission:
    """One admitted request's hold on its tenant's limits, until :meth:`release`."""

    __slots__ = ("_limits", "batch", "engine_requests", "released", "tenant")

    def __init__(self, limits: CallerLimits, tenant: str):
        self._limits = limits
        self.tenant = tenant
        #: Engine requests held for this request: the window its prompts run through.
        self.engine_requests = 1
        self.released = False
        #: A batch of prompts (:meth:`widen`), not a turn.
        self.batch = False

    def widen(self, wanted: int) -> int:
        """Hold up to ``wanted`` engine requests for this request (a batch's window), as many
        as its tenant has left, and at least the one it holds; how many it now holds. The
        request counts as a batch from then on."""
        limits = self._limits
        if not self.batch and not self.released:
            self.batch = True
            limits.batches += 1
        if wanted > self.engine_requests and not self.released:
            extra = wanted - self.engine_requests
            if limits.max_engine_requests:
                held = limits.engine_requests.get(self.tenant, 0)
                extra = min(extra, max(0, limits.max_engine_requests - held))
            limits.engine_requests[self.tenant] = limits.engine_requests.get(self.tenant, 0) + extra
            self.engine_requests += extra
        return self.engine_requests

    def release(self) -> None:
        """The request's reply is whole, failed or abandoned: what it held is let go (once)."""
        if not self.released:
            self.released = True
            self._limits._give_back(self.tenant, self.engine_requests, self.batch)


def _decrease(counts: dict[str, int], tenant: str, by: int) -> None:
    left = counts.get(tenant, 0) - by
    if left > 0:
        counts[tenant] = left
    else:
        counts.pop(tenant, None)
