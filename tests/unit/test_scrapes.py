"""Scrapes rendered afresh a bounded number of times a second (issue #39, case 3)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.scrapes import BURST, RENDERS_PER_S, Rendered, Scrape
from tests.gateway_fixtures import GatewayThread, running_fake_engine, running_gateway


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_route_renders_afresh_until_its_bucket_is_spent_then_answers_the_last() -> None:
    clock = _Clock()
    scrape = Scrape(per_s=4, burst=3, clock=clock)
    rendered = 0

    async def render() -> Rendered:
        nonlocal rendered
        rendered += 1
        return Rendered(200, str(rendered).encode(), "text/plain")

    bodies = [(await scrape.answer(render)).body for _ in range(5)]
    assert bodies == [b"1", b"2", b"3", b"3", b"3"]  # three fresh, then the last
    clock.now += 0.25  # one render's worth of time: one fresh again
    assert (await scrape.answer(render)).body == b"4"
    assert (await scrape.answer(render)).body == b"4"
    clock.now += 10  # a pause refills the bucket, never past its burst
    bodies = [(await scrape.answer(render)).body for _ in range(5)]
    assert bodies == [b"5", b"6", b"7", b"7", b"7"]
    assert scrape.renders == rendered == 7


async def test_scrapes_that_arrive_during_a_render_share_it() -> None:
    scrape = Scrape(per_s=1000, burst=1000)
    rendered = 0
    gate = asyncio.Event()

    async def render() -> Rendered:
        nonlocal rendered
        rendered += 1
        await gate.wait()
        return Rendered(200, b"x", "text/plain")

    answers = [asyncio.ensure_future(scrape.answer(render)) for _ in range(10)]
    await asyncio.sleep(0)
    gate.set()
    assert {a.body for a in await asyncio.gather(*answers)} == {b"x"}
    assert rendered == 1


@pytest.fixture
def gateway() -> Iterator[GatewayThread]:
    with (
        running_fake_engine() as fake,
        running_gateway(
            GatewayConfig(prefill=endpoints([fake]), decode=endpoints([fake], [fake]))
        ) as running,
    ):
        yield running


def _turns_counted(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvturn_turns_total{")
    )


def test_a_scrape_loop_costs_a_bounded_number_of_renders_and_a_slow_scraper_sees_fresh(
    gateway: GatewayThread,
) -> None:
    """200 scrapes of each route back to back: every answer whole, each route rendered at
    most its burst plus its rate over the time taken; a scraper below the rate (after a
    pause) sees a turn made just before."""
    scrapes = gateway.app.state.gateway.scrapes
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        began = time.monotonic()
        for _ in range(200):
            assert client.get("/metrics").text.startswith("# HELP")
            assert client.get("/kvturn/status").json()["process"]["pid"] == os.getpid()
        renders = BURST + (time.monotonic() - began) * RENDERS_PER_S + 1
        assert 1 <= scrapes["metrics"].renders <= renders
        assert 1 <= scrapes["status"].renders <= renders
        assert scrapes["metrics"].renders < 200  # the loop was answered from the last render
        time.sleep(1.0)  # below the rate again
        before = _turns_counted(client.get("/metrics").text)
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert _turns_counted(client.get("/metrics").text) == before + 1
