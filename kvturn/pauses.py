"""How long pauses between turns last: an online lognormal, robust to absurd reports.

Shared by decode's lease table (a model per pause kind, fed by the clients' reported pauses:
which lease to reclaim first) and the gateway (a model per tenant, fed by the gaps it sees
between a conversation's turns: how long to lease the KV of a client that sends no
heartbeats). Plain Python, no dependencies.
"""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["LogNormal"]

_STANDARD = NormalDist()


class LogNormal:
    """Pause lengths as a lognormal, learned online (Welford on ``log(seconds)``), starting
    from a prior of ``prior_weight`` pseudo-observations (none: the first observation sets the
    median, and the spread is learned from there).

    An observation counts as at most :attr:`CLIP_SIGMAS` (current) standard deviations from
    the mean, in log space: one absurd report (a client's clock, a tenant's 1e308) moves the
    model as far as one unusual pause, while a real shift still moves it, observation by
    observation. Not thread-safe: its owner locks.
    """

    CLIP_SIGMAS = 3.0
    #: The least spread the model assumes (log space): pauses are never exactly regular.
    MIN_SIGMA = 0.05

    __slots__ = ("_m2", "_mean", "_n")

    def __init__(self, median_s: float = 1.0, sigma: float = 1.0, prior_weight: float = 0.0):
        self._n = prior_weight
        self._mean = math.log(median_s)
        self._m2 = sigma * sigma * prior_weight

    @property
    def observations(self) -> float:
        """Observations so far, the prior's pseudo-observations included."""
        return self._n

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        x = math.log(max(seconds, 1e-3))
        if self._n >= 2:
            reach = self.CLIP_SIGMAS * self.sigma
            x = min(max(x, self._mean - reach), self._mean + reach)
        self._n += 1
        delta = x - self._mean
        self._mean += delta / self._n
        self._m2 += delta * (x - self._mean)

    @property
    def mu(self) -> float:
        """Mean of ``log(seconds)``."""
        return self._mean

    @property
    def sigma(self) -> float:
        """Standard deviation of ``log(seconds)`` (at least :attr:`MIN_SIGMA`)."""
        if self._n <= 0:
            return self.MIN_SIGMA
        return max(math.sqrt(self._m2 / self._n), self.MIN_SIGMA)

    def cdf(self, seconds: float) -> float:
        """P(a pause ends within ``seconds``)."""
        if seconds <= 0:
            return 0.0
        return 0.5 * math.erfc(-(math.log(seconds) - self.mu) / (self.sigma * math.sqrt(2)))

    def quantile(self, q: float) -> float:
        """The length within which a share ``q`` of pauses end."""
        return math.exp(self.mu + self.sigma * _STANDARD.inv_cdf(q))

    def return_probability(self, paused_s: float, horizon_s: float) -> float:
        """P(the pause ends within ``horizon_s`` | it has lasted ``paused_s`` so far)."""
        done = self.cdf(paused_s)
        survival = 1.0 - done
        if survival <= 1e-12:
            return 0.0
        return max(0.0, (self.cdf(paused_s + horizon_s) - done) / survival)
