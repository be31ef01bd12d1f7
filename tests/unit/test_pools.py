from __future__ import annotations

import asyncio

import pytest

from kvturn.gateway.config import endpoints
from kvturn.gateway.errors import NoHealthyEngine
from kvturn.gateway.pools import Pool, check_health_forever


def test_choose_least_loaded_and_prefer_the_holder_on_ties() -> None:
    pool = Pool("decode", endpoints(["http://a", "http://b", "http://c"]))
    a, b, c = pool.instances
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    assert pool.choose() is b
    assert pool.choose(prefer="http://c") is c
    assert pool.choose(prefer="http://a") is b  # the holder is busier: load wins
    assert pool.choose(exclude=b) is c
    b.healthy = c.healthy = False
    assert pool.choose() is a
    a.healthy = False
    with pytest.raises(NoHealthyEngine):
        pool.choose()


def test_a_preferred_instance_keeps_its_turns_within_the_slack() -> None:
    pool = Pool("prefill", endpoints(["http://a", "http://b"]))
    a, b = pool.instances
    a.in_flight, b.in_flight = 3, 1
    assert pool.choose(prefer="http://a", slack=2) is a
    a.in_flight = 4  # three more than b: load wins
    assert pool.choose(prefer="http://a", slack=2) is b
    a.healthy = False
    assert pool.choose(prefer="http://a", slack=10) is b


def test_affinity_is_stable_spread_and_moves_only_the_leavers_keys() -> None:
    urls = ["http://p0", "http://p1", "http://p2"]
    pool = Pool("prefill", endpoints(urls))
    keys = [f"conversation {i}".encode() for i in range(300)]
    placed = {key: pool.affine(key) for key in keys}
    assert placed == {key: pool.affine(key) for key in keys}  # stable
    counts = [list(placed.values()).count(url) for url in urls]
    assert min(counts) > 60, counts  # spread (100 each on average)
    smaller = Pool("prefill", endpoints(urls[:2]))
    for key, url in placed.items():
        if url != "http://p2":  # only the keys of the instance that left move
            assert smaller.affine(key) == url
    assert Pool("prefill", []).affine(b"k") is None
    # Service names as Kubernetes spells them: the URLs differ only past their 64th byte.
    long = [
        f"http://kvturn-prefill.inference.svc.cluster.local.example.internal:{p}"
        for p in (8000, 8001)
    ]
    assert len(long[0]) > 64 and long[0][:64] == long[1][:64]
    pool = Pool("prefill", endpoints(long))
    assert {pool.affine(key) for key in keys} == set(long)


class FlakyUpstream:
    def __init__(self) -> None:
        self.down: set[str] = {"http://b"}

    async def is_healthy(self, url: str) -> bool:
        return url not in self.down


async def test_health_checks_drop_and_readmit() -> None:
    pool = Pool("prefill", endpoints(["http://a", "http://b"]))
    upstream = FlakyUpstream()
    task = asyncio.create_task(check_health_forever([pool], upstream, 0.01))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert [i.healthy for i in pool.instances] == [True, False]
    upstream.down = set()
    await asyncio.sleep(0.05)
    assert [i.healthy for i in pool.instances] == [True, True]
    task.cancel()


class DrainingUpstream(FlakyUpstream):
    def __init__(self) -> None:
        super().__init__()
        self.down = set()
        self.draining: set[str] = set()

    async def is_draining(self, control_url: str) -> bool | None:
        return None if control_url == "http://unknown-control" else control_url in self.draining


async def test_a_draining_engine_takes_no_new_turns_until_the_drain_is_called_off() -> None:
    pool = Pool(
        "decode",
        endpoints(
            ["http://a", "http://b", "http://c"],
            ["http://a-control", "http://b-control", "http://unknown-control"],
        ),
    )
    a, b, c = pool.instances
    upstream = DrainingUpstream()
    upstream.draining = {"http://a-control"}
    task = asyncio.create_task(check_health_forever([pool], upstream, 0.01))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert [i.draining for i in pool.instances] == [True, False, False]
    assert a.healthy  # it answers: the history it holds can still be read from it
    assert pool.healthy() == [b, c]
    assert pool.choose(prefer="http://a") is b  # its own conversations go elsewhere
    b.healthy = c.healthy = False
    with pytest.raises(NoHealthyEngine):
        pool.choose()
    upstream.draining = set()
    await asyncio.sleep(0.05)
    assert pool.choose() is a
    task.cancel()
