"""The gateway in front of a stock vLLM engine: a decode started with vLLM's own NixlConnector
(what a deployment that does not install kvturn beside vLLM runs), no kvturn control server.
Plain P/D: every turn is answered, with one engine alone's greedy answer, and recomputes (there
is no lease to reuse); nothing fails for want of kvturn's connector."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.launch.engines import EngineProcess, wait_until_healthy
from tests.conftest import LocalPair
from tests.engine_requests import extra_decode_spec, long_prompt, single_engine_ids
from tests.gateway_fixtures import run_turn, running_gateway

pytestmark = pytest.mark.engines


def test_a_stock_decode_serves_plain_pd(local_pair: LocalPair, tmp_path: Path) -> None:
    spec = extra_decode_spec(local_pair, 70, control_port=0)
    spec = replace(spec, kv=replace(spec.kv, stock=True))
    assert spec.kv_transfer_config() == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
    }  # fmt: skip
    stock = EngineProcess(spec, tmp_path / "stock-decode.log").start()
    try:
        wait_until_healthy([stock], timeout_s=900)
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            decode=endpoints([spec.url]),  # no control URL: a stock engine has none
        )
        with running_gateway(config) as gateway:
            client = openai.OpenAI(
                base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=300
            )
            messages = [{"role": "user", "content": long_prompt(600, "stock decode")}]
            for turn in range(3):
                for stream in (False, True):
                    result = run_turn(
                        client, local_pair.model, messages, "stock-conversation", stream=stream
                    )
                    assert result.plan == "recompute", (turn, stream, result)
                    expected = single_engine_ids(local_pair.prefill_url, local_pair.model,
                                                 messages, 16)  # fmt: skip
                    assert result.token_ids == expected, (turn, stream)
                messages = [
                    *messages,
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": f"And then, part {turn + 2}?"},
                ]
    finally:
        stock.stop()
