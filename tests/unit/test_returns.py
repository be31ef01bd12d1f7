"""Lease lengths learned from how long a tenant's conversations take to come back
(gateway/returns.py, kvturn/pauses.py), and the gateway asking for them."""

from __future__ import annotations

import math
import random
import time

import httpx
import pytest

from kvturn.gateway.auth import ApiKeys
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.returns import ReturnLeases
from kvturn.pauses import LogNormal
from tests.gateway_fixtures import running_fake_engine, running_gateway


def test_a_lognormal_learns_its_median_and_spread() -> None:
    rng = random.Random(3)
    model = LogNormal()
    for _ in range(4000):
        model.observe(rng.lognormvariate(math.log(4.0), 0.5))
    assert model.quantile(0.5) == pytest.approx(4.0, rel=0.05)
    assert model.sigma == pytest.approx(0.5, rel=0.05)
    assert model.quantile(0.95) == pytest.approx(4.0 * math.exp(0.5 * 1.6449), rel=0.06)
    assert model.cdf(model.quantile(0.8)) == pytest.approx(0.8)


def test_an_absurd_report_moves_a_lognormal_as_far_as_one_unusual_pause() -> None:
    model, control = LogNormal(2.0, 1.0, 5.0), LogNormal(2.0, 1.0, 5.0)
    model.observe(1e308)
    control.observe(2.0 * math.exp(3.0))  # three spreads out: the farthest a report counts
    assert model.mu == pytest.approx(control.mu) and model.sigma == pytest.approx(control.sigma)
    for bad in (math.nan, math.inf, -1.0, 0.0):
        model.observe(bad)
    assert model.observations == 6


def test_a_tenant_is_leased_lease_s_until_its_gaps_are_known() -> None:
    leases = ReturnLeases(lease_s=60)
    for _ in range(ReturnLeases.MIN_GAPS - 1):
        leases.observe("a", 1.5)
    assert leases.lease_for("a") == 60
    leases.observe("a", 1.5)
    assert leases.lease_for("a") < 60


def test_the_learned_lease_covers_most_returns_and_no_more() -> None:
    rng = random.Random(7)
    leases = ReturnLeases(lease_s=60)
    gaps = [rng.lognormvariate(math.log(8.0), 0.4) for _ in range(400)]
    for gap in gaps:
        leases.observe("a", gap)
    lease = leases.lease_for("a")
    covered = sum(gap + ReturnLeases.MARGIN_S <= lease for gap in gaps) / len(gaps)
    # About COVERAGE of the gaps fit (and the turn's margin); the lease is a third of lease_s.
    assert 0.9 <= covered <= 0.99, covered
    assert 12 < lease < 20, lease
    # Agents that come straight back are leased the floor, not a minute.
    for _ in range(50):
        leases.observe("quick", rng.uniform(0.2, 1.0))
    assert leases.lease_for("quick") == ReturnLeases.FLOOR_S
    # Gaps longer than lease_s: lease_s, never more.
    for _ in range(50):
        leases.observe("slow", rng.uniform(100, 300))
    assert leases.lease_for("slow") == 60


def test_one_tenants_gaps_never_move_anothers_lease() -> None:
    leases = ReturnLeases(lease_s=60)
    for _ in range(50):
        leases.observe("a", 20.0)
    before = leases.lease_for("a")
    for _ in range(500):
        leases.observe("b", 0.01)
    leases.observe("b", 1e308)
    assert leases.lease_for("a") == before
    assert ReturnLeases(lease_s=60, enabled=False).lease_for("a") == 60


def test_the_gateway_learns_a_tenants_lease_from_its_conversations_gaps() -> None:
    """A client that sends no heartbeats comes back within a second, turn after turn: its
    lease falls from lease_s towards the floor once its gaps are known, and the header tells
    it; another tenant's lease is
    untouched; a client that beats gets the heartbeat lease whatever its tenant's gaps."""
    keys = ApiKeys([("key-a-0123456789ab", "a"), ("key-b-0123456789ab", "b")])
    with running_fake_engine() as fake:
        config = GatewayConfig(
            prefill=endpoints([fake]),
            decode=endpoints([fake], [fake]),
            api_keys=keys,
            learned_lease=True,
        )
        with running_gateway(config) as gateway:

            def turn(key: str, conversation: str, **headers: str) -> str:
                headers.update(Authorization=f"Bearer {key}")
                headers["X-Conversation-Id"] = conversation
                response = httpx.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
                    headers=headers,
                )
                assert response.status_code == 200, response.text
                return response.headers["x-kvturn-lease-seconds"]

            leases = []
            for _ in range(ReturnLeases.MIN_GAPS + 2):
                leases.append(turn("key-a-0123456789ab", "quick"))
                time.sleep(0.05)  # the record lands: the next turn's gap follows it
            learned = [float(x) for x in leases]
            assert learned[: ReturnLeases.MIN_GAPS] == [60.0] * ReturnLeases.MIN_GAPS, leases
            assert ReturnLeases.FLOOR_S <= learned[-1] < 10, leases
            assert turn("key-b-0123456789ab", "other") == "60"
            beats = turn("key-a-0123456789ab", "beats", **{"X-Kvturn-Heartbeats": "on"})
            assert float(beats) == config.heartbeat_lease_s
