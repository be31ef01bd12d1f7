"""The stand-in gateway plans only what the real gateway plans (issue 18)."""

from __future__ import annotations

import time
from typing import get_args

from kvturn_stub_gateway import StubGateway
from kvturn_test_helpers import REUSE_PLANS, USER

from kvturn.client import OpenAI
from kvturn.gateway.planner import PlanName


def test_the_stand_ins_plans_are_the_real_gateways(stub: StubGateway) -> None:
    stub.lease_seconds = 0.3
    client = OpenAI(base_url=stub.url, api_key="test", heartbeats=False)
    with client.conversation("plans") as conversation:
        for pause_s in (0.0, 0.0, 0.6):  # the last pause outlives the lease
            time.sleep(pause_s)
            client.chat.completions.create(model="m", messages=USER)
    client.close()
    plans = [turn.plan for turn in conversation.turns]
    assert plans == ["recompute", "pull-reuse", "recompute"]
    assert set(plans) | set(REUSE_PLANS) <= set(get_args(PlanName))
