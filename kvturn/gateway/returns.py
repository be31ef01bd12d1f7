"""How long to lease the KV of a client that sends no heartbeats: as long as its tenant's
conversations take to come back, learned from the gaps the gateway sees between their turns.

A client that beats through its pauses gets the short heartbeat lease and keeps its KV as long
as it beats (``GatewayConfig.heartbeat_lease_s``). A client that does not (a plain OpenAI
client naming its conversation, AIPerf, vllm-router's users) can only be given a lease that
spans its whole pause. With ``GatewayConfig.learned_lease`` on (the default) that is
``lease_s`` (60 s) until its tenant's gaps are known, then the length within which
:attr:`ReturnLeases.COVERAGE` (95 %) of them end, plus a margin for the turn's own way to the
KV, bounded by ``[FLOOR_S, lease_s]``; off, always ``lease_s``. An agent that
comes back within two seconds is no longer leased for a minute after it stopped for good, and
one whose user reads for forty seconds still finds its KV.

The gaps are per tenant (one tenant's traffic never shortens another's leases) and robust to
outliers (:class:`~kvturn.pauses.LogNormal`); each gateway replica learns its own.
"""

from __future__ import annotations

from collections import OrderedDict

from kvturn.pauses import LogNormal

__all__ = ["ReturnLeases"]


class ReturnLeases:
    """Per-tenant lease lengths for clients that send no heartbeats."""

    #: Share of next turns the lease is meant to be there for.
    COVERAGE = 0.95
    #: Gaps of a tenant seen before its lease is learned rather than ``lease_s``.
    MIN_GAPS = 8
    #: Added to the learned length: from the turn's arrival to its read of the KV (planning, a
    #: claim, prefill's start) and clock noise.
    MARGIN_S = 2.0
    #: The shortest learned lease.
    FLOOR_S = 5.0
    #: A prior that keeps the spread wide until a tenant's own gaps outweigh it (pseudo
    #: observations of a 10 s median, log-spread 1.5: "anything from a second to a minute").
    PRIOR = (10.0, 1.5, 2.0)
    #: Tenants remembered (least recently seen forgotten beyond).
    MAX_TENANTS = 10_000

    def __init__(self, lease_s: float, enabled: bool = True):
        self.lease_s = lease_s
        self.enabled = enabled
        self._tenants: OrderedDict[str, LogNormal] = OrderedDict()

    def observe(self, tenant: str, gap_s: float) -> None:
        """A conversation of ``tenant`` came back ``gap_s`` after its last turn ended."""
        if not self.enabled:
            return
        model = self._tenants.get(tenant)
        if model is None:
            model = self._tenants[tenant] = LogNormal(*self.PRIOR)
            while len(self._tenants) > self.MAX_TENANTS:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        model.observe(gap_s)

    def lease_for(self, tenant: str) -> float:
        """The lease to ask for a turn of ``tenant`` whose client sends no heartbeats."""
        model = self._tenants.get(tenant)
        if model is None or model.observations - self.PRIOR[2] < self.MIN_GAPS:
            return self.lease_s
        learned = model.quantile(self.COVERAGE) + self.MARGIN_S
        return min(self.lease_s, max(self.FLOOR_S, learned))
