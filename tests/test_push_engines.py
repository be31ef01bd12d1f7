"""Push mode on real engines: prefill WRITEs into blocks decode registered while prefill ran
(vLLM's NixlPushConnector, under kvturn's ``KvturnPushConnector``), and reuse across turns in
the same deployment (decode-local continuation on the holder).

Runs at the end of the session: it stops the session's pull pair (this machine holds three
engines at most) and starts two push prefills and one push decode. The pull reference is taken
on the session's pair first, by the module's first test.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.launch.engines import (
    Deployment,
    EngineProcess,
    KVSettings,
    plan_specs,
    start_engines,
)
from tests.conftest import TEST_BASE_PORT, TEST_KV_TTL_S, LocalPair
from tests.engine_requests import kv_usage, long_prompt, single_engine_ids
from tests.gateway_fixtures import TurnResult, metric, run_turn, running_gateway
from tests.test_engine_pools import _stop_session_pair

pytestmark = pytest.mark.engines

PUSH_BASE_PORT = TEST_BASE_PORT + 600
MAX_TOKENS = 16
#: A decode's blocks registered for a push that never came are freed this long after the
#: request was aborted (``push_registration_timeout``).
REGISTRATION_TIMEOUT_S = 10
SECRET = "push-test-" + uuid.uuid4().hex


def _conversation() -> list[list[dict[str, Any]]]:
    """Three turns' new messages: a long first prompt, then a tool result, then a user line."""
    return [
        [{"role": "user", "content": long_prompt(1500, "push " + uuid.uuid4().hex)}],
        [{"role": "user", "content": "The tool says: " + "the gauge reads 7. " * 6}],
        [{"role": "user", "content": "Go on, in one line."}],
    ]


def _run(client: openai.OpenAI, model: str, turns: list[list[dict[str, Any]]], name: str) -> Any:
    """The conversation through a gateway: each turn's result and the messages it was sent."""
    messages: list[dict[str, Any]] = []
    results: list[tuple[TurnResult, list[dict[str, Any]]]] = []
    for i, new in enumerate(turns):
        messages = [*messages, *new]
        got = run_turn(client, model, messages, name, stream=i != 1, max_tokens=MAX_TOKENS)
        results.append((got, messages))
        messages = [*messages, {"role": "assistant", "content": got.text}]
    return results


@pytest.fixture(scope="session")
def pull_turns(local_pair: LocalPair) -> Any:
    """The conversation on the session's pull pair: the reference push must equal. Taken by
    the first test below, while the pair runs; session-scoped, as the tests that stop the
    pair run at the session's end, after pytest has left this module once."""
    turns = _conversation()
    client = openai.OpenAI(base_url=local_pair.gateway_url, api_key="-", max_retries=0)
    return turns, _run(client, local_pair.model, turns, "push-reference-" + uuid.uuid4().hex)


def test_the_pull_reference_reuses_and_equals_one_engine(
    local_pair: LocalPair, pull_turns: Any
) -> None:
    _, results = pull_turns
    assert [got.plan for got, _ in results][1:] == ["decode-local", "decode-local"]
    for got, messages in results:
        want = single_engine_ids(local_pair.prefill_url, local_pair.model, messages, MAX_TOKENS)
        assert got.token_ids == want


@pytest.fixture(scope="module")
def push_engines(
    local_pair: LocalPair, pull_turns: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    _stop_session_pair(local_pair)
    saved = os.environ.get("KVTURN_CONTROL_SECRET")
    os.environ["KVTURN_CONTROL_SECRET"] = SECRET
    kv = KVSettings(
        transfer="push",
        decoder_kv_blocks_ttl_s=TEST_KV_TTL_S,
        push_registration_timeout_s=REGISTRATION_TIMEOUT_S,
    )
    specs = plan_specs(
        Path(str(local_pair.state["model_path"])),
        num_prefill=2,
        num_decode=1,
        base_port=PUSH_BASE_PORT,
        kv=kv,
        served_model_name=local_pair.model,
        # As the session's pull pair runs (tests/conftest.py): the two are compared.
        prefill_prefix_caching=False,
    )
    deployment = start_engines(specs, tmp_path_factory.mktemp("push") / "logs", timeout_s=900)
    try:
        yield deployment
    finally:
        deployment.stop()
        if saved is None:
            os.environ.pop("KVTURN_CONTROL_SECRET", None)
        else:
            os.environ["KVTURN_CONTROL_SECRET"] = saved


def _config(deployment: Deployment, prefill: int) -> GatewayConfig:
    spec = deployment.prefill[prefill].spec
    decode = deployment.decode[0].spec
    return GatewayConfig(
        prefill=endpoints([spec.url], [spec.control_url or ""]),
        decode=endpoints([decode.url], [decode.control_url or ""]),
        control_secret=SECRET,
        transfer="push",
    )


@pytest.mark.stops_engines
def test_push_turns_equal_pull_and_one_engine_and_reuse_on_the_holder(
    local_pair: LocalPair, pull_turns: Any, push_engines: Deployment
) -> None:
    turns, pulled = pull_turns
    decode_url = push_engines.decode[0].spec.url
    with running_gateway(_config(push_engines, 0)) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        pushed = _run(client, local_pair.model, turns, "push-" + uuid.uuid4().hex)
        plans = [(got.plan, got.reason) for got, _ in pushed]
        # Turn 1 goes through prefill (pushed to decode); the next two continue on decode,
        # whose retained blocks serve the history: the header and the metrics say so.
        assert plans[0] == ("recompute", "first-turn")
        assert [plan for plan, _ in plans[1:]] == ["decode-local", "decode-local"], plans
        assert all(got.reused_tokens >= 1280 for got, _ in pushed[1:])
        assert metric(gateway.url + "/metrics", 'kvturn_turns_total{plan="decode-local"}') == 2
        assert metric(gateway.url + "/metrics", "kvturn_reused_tokens_total") >= 2560
        for (push, messages), (pull, _) in zip(pushed, pulled, strict=True):
            assert push.token_ids == pull.token_ids
            want = single_engine_ids(decode_url, local_pair.model, messages, MAX_TOKENS)
            assert push.token_ids == want

        # A completion (batched: each prompt is a push pair of its own) equals one engine.
        prompts = [long_prompt(300, "push batch a"), long_prompt(300, "push batch b")]
        batch = client.completions.create(
            model=local_pair.model, prompt=prompts, max_tokens=8, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        for choice in sorted(batch.choices, key=lambda c: c.index):
            alone = httpx.post(
                f"{decode_url}/v1/completions",
                json={"model": local_pair.model, "prompt": prompts[choice.index],
                      "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                      "cache_salt": uuid.uuid4().hex},
                timeout=120,
            ).json()  # fmt: skip
            assert getattr(choice, "token_ids", None) == alone["choices"][0]["token_ids"]


def _turn_killing_once_registered(
    gateway_url: str, model: str, name: str, decode_url: str, victim: EngineProcess
) -> tuple[TurnResult, list[dict[str, Any]]]:
    """A streamed 16k-token turn (long enough that prefill is still computing, seconds on the
    tiny model) through the gateway; ``victim`` is killed as soon as decode has registered
    its blocks (decode's KV usage rises as it schedules the request). The turn's result, and
    its messages; it must end, without an error, within 240 s."""
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="-", max_retries=0, timeout=240)
    baseline = kv_usage(decode_url)
    messages = [{"role": "user", "content": long_prompt(16000, name)}]
    outcome: dict[str, Any] = {}

    def turn() -> None:
        try:
            outcome["got"] = run_turn(client, model, messages, name, stream=True)
        except openai.APIError as error:
            outcome["error"] = error

    worker = threading.Thread(target=turn)
    worker.start()
    started = time.monotonic()
    while kv_usage(decode_url) <= baseline:
        assert time.monotonic() - started < 60, "decode never allocated the turn's blocks"
        time.sleep(0.05)
    assert victim.pid is not None
    os.killpg(victim.pid, signal.SIGKILL)
    worker.join(timeout=240)
    assert not worker.is_alive(), f"the turn hung after {victim.spec.name} died"
    assert "error" not in outcome, outcome["error"]
    return outcome["got"], messages


@pytest.mark.stops_engines
def test_prefill_killed_between_registration_and_write(
    local_pair: LocalPair, push_engines: Deployment
) -> None:
    victim = push_engines.prefill[1]
    decode_url = push_engines.decode[0].spec.url
    with running_gateway(_config(push_engines, 1)) as gateway:
        baseline = kv_usage(decode_url)
        name = "push-killed-" + uuid.uuid4().hex
        got, messages = _turn_killing_once_registered(
            gateway.url, local_pair.model, name, decode_url, victim
        )
        # Served by the decode alone, with the answer one engine gives.
        assert (got.plan, got.reason) == ("recompute", "prefill-failed")
        assert got.token_ids == single_engine_ids(decode_url, local_pair.model, messages, 16)
        # The conversation ends: its lease goes. What the aborted push registered goes once
        # the registration times out: decode's KV usage returns to where it was.
        httpx.delete(f"{gateway.url}/v1/kvturn/conversations/{name}", timeout=30)
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S + 30
        while kv_usage(decode_url) > baseline:
            assert time.monotonic() < deadline, (
                f"decode's KV usage stayed at {kv_usage(decode_url)} (baseline {baseline})"
            )
            time.sleep(0.5)


@pytest.mark.stops_engines
def test_decode_killed_after_registering(local_pair: LocalPair, push_engines: Deployment) -> None:
    """Decode registered its blocks with prefill, then died: the turn is recomputed, never a
    hang or a 5xx; with no decode left, a prefill engine serves it alone, with the answer one
    engine gives. Prefill frees the blocks it computed for a write that cannot land
    (upstream's prefill-side lease, ``kv_lease_duration``, 30 s, which heartbeats from a dead
    decode no longer renew)."""
    prefill_url = push_engines.prefill[0].spec.url
    victim = push_engines.decode[0]
    with running_gateway(_config(push_engines, 0)) as gateway:
        name = "orphan-" + uuid.uuid4().hex
        got, messages = _turn_killing_once_registered(
            gateway.url, local_pair.model, name, victim.spec.url, victim
        )
        assert (got.plan, got.reason) == ("recompute", "no-decode")
        assert got.token_ids == single_engine_ids(prefill_url, local_pair.model, messages, 16)
        # Prefill computed the prompt (its KV waits for a write that cannot land), then frees it.
        deadline = time.monotonic() + 90
        while kv_usage(prefill_url) > 0:
            assert time.monotonic() < deadline, f"prefill still holds {kv_usage(prefill_url)}"
            time.sleep(1)
