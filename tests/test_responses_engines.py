"""The Responses API through the gateway on real engines: chained turns and full-input turns
reuse KV, and every answer equals one engine alone answering the same Responses request
(vLLM's own ``/v1/responses``, with the whole history as input and a fresh cache salt: no KV
of the gateway's path can have touched it, and the gateway's translation to a chat turn is
checked against vLLM's own at the same time)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from tests.conftest import LocalPair
from tests.engine_requests import KV_BYTES_PER_TOKEN, NixlReads, long_prompt
from tests.gateway_fixtures import running_gateway, running_redis

pytestmark = pytest.mark.engines

MAX_TOKENS = 16
REUSE_PLANS = ("pull-reuse", "decode-local")
INSTRUCTIONS = "You are a careful agent that reads tool output."


@pytest.fixture(scope="module")
def gateway(local_pair: LocalPair) -> Iterator[GatewayThread]:
    config = GatewayConfig(
        prefill=endpoints([local_pair.prefill_url]),
        decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
        control_secret=local_pair.control_secret,
    )
    with running_gateway(config) as running:
        yield running


@pytest.fixture
def client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=300)


def engine_alone_text(pair: LocalPair, body: dict[str, Any]) -> str:
    """What one engine alone answers to a Responses request with this whole input."""
    alone = {**body, "store": False, "stream": False, "cache_salt": uuid.uuid4().hex}
    alone.pop("previous_response_id", None)
    response = httpx.post(f"{pair.prefill_url}/v1/responses", json=alone, timeout=300)
    response.raise_for_status()
    return openai.types.responses.Response.model_validate(response.json()).output_text


def _stream(
    client: openai.OpenAI, **body: Any
) -> tuple[openai.types.responses.Response, dict[str, str], list[str]]:
    """One streamed Responses turn: the final response, the gateway's headers, event types."""
    with client.responses.with_streaming_response.create(stream=True, **body) as raw:
        headers = dict(raw.headers)
        kinds: list[str] = []
        final = None
        for event in raw.parse():
            kinds.append(event.type)
            if event.type == "response.completed" or event.type == "response.incomplete":
                final = event.response
    assert final is not None, kinds
    return final, headers, kinds


def test_four_chained_streamed_turns_reuse_and_equal_one_engine_alone(
    local_pair: LocalPair, client: openai.OpenAI
) -> None:
    topic = f"harbour cranes {uuid.uuid4().hex[:6]}"
    inputs = [
        long_prompt(1500, topic),
        "Tool result: crane 4 lifted 31 containers. " * 3,
        "Tool result: crane 7 is idle, wind 40 knots. " * 3,
        "Summarise what the cranes did.",
    ]
    prefill_reads = NixlReads(local_pair.prefill_url)
    previous: str | None = None
    history: list[dict[str, Any]] = []
    plans = []
    for turn, text in enumerate(inputs):
        asked = {
            "model": local_pair.model, "instructions": INSTRUCTIONS, "input": text,
            "max_output_tokens": MAX_TOKENS, "temperature": 0,
        }  # fmt: skip
        if previous is not None:
            asked["previous_response_id"] = previous
        response, headers, kinds = _stream(client, **asked)
        assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
        plans.append(headers["x-kvturn-plan"])
        history.append({"role": "user", "content": text})
        want = engine_alone_text(local_pair, {**asked, "input": history})
        assert response.output_text == want, f"turn {turn + 1} differs from one engine alone"
        history.extend(item.model_dump(exclude_none=True) for item in response.output)
        if turn == 0:
            assert headers["x-kvturn-plan"] == "recompute"
        else:
            assert headers["x-kvturn-plan"] in REUSE_PLANS, (turn, headers)
            assert int(headers["x-kvturn-reused-tokens"]) > 1000, (turn, headers)
            assert response.previous_response_id == previous
            assert response.usage is not None
            assert response.usage.input_tokens_details.cached_tokens > 1000
        previous = response.id
    pulls = plans.count("pull-reuse")
    if pulls:  # a pull's evidence is prefill's own NIXL reads, not the header
        assert prefill_reads.wait_for(pulls, min_bytes=1000 * KV_BYTES_PER_TOKEN) > 0


def test_full_input_without_storing_reuses_by_its_messages(
    local_pair: LocalPair, client: openai.OpenAI
) -> None:
    opening = [{"role": "user", "content": long_prompt(1200, f"salt marsh {uuid.uuid4()}")}]
    asked = {
        "model": local_pair.model, "instructions": INSTRUCTIONS, "max_output_tokens": MAX_TOKENS,
        "temperature": 0, "store": False,
    }  # fmt: skip
    first = client.responses.with_raw_response.create(input=opening, **asked)
    assert first.headers["x-kvturn-plan"] == "recompute"
    following = [
        *opening,
        *(item.model_dump(exclude_none=True) for item in first.parse().output),
        {"role": "user", "content": "Tool result: the tide is out. " * 4},
    ]
    second = client.responses.with_raw_response.create(input=following, **asked)
    assert second.headers["x-kvturn-plan"] in REUSE_PLANS
    assert int(second.headers["x-kvturn-reused-tokens"]) > 1000
    assert second.headers["x-conversation-id"].startswith("implicit-")
    assert second.parse().output_text == engine_alone_text(
        local_pair, {**asked, "input": following}
    )
    with pytest.raises(openai.NotFoundError):  # not stored: nothing to fetch or chain to
        client.responses.retrieve(second.parse().id)


def test_unknown_previous_response_gets_the_apis_404(
    local_pair: LocalPair, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model=local_pair.model, input="hi", previous_response_id="resp_never_made"
        )
    assert caught.value.code == "previous_response_not_found"
    assert "resp_never_made" in caught.value.message


def test_conversation_parameter_keeps_the_history_and_reuses(
    local_pair: LocalPair, client: openai.OpenAI
) -> None:
    """As with OpenAI's conversations, a turn naming a ``conversation`` sends only what is
    new: the gateway prepends the conversation's items so far."""
    conversation = f"conv_{uuid.uuid4().hex[:10]}"
    asked = {
        "model": local_pair.model, "instructions": INSTRUCTIONS, "max_output_tokens": MAX_TOKENS,
        "temperature": 0, "conversation": conversation,
    }  # fmt: skip
    opening = long_prompt(1200, f"glacier {uuid.uuid4()}")
    first = client.responses.with_raw_response.create(input=opening, **asked)
    assert first.headers["x-kvturn-plan"] == "recompute"
    assert first.headers["x-conversation-id"] == conversation
    follow_up = "Tool result: the glacier moved 3 metres. " * 3
    second = client.responses.with_raw_response.create(input=follow_up, **asked)
    assert second.headers["x-kvturn-plan"] in REUSE_PLANS
    assert int(second.headers["x-kvturn-reused-tokens"]) > 1000
    history = [
        {"role": "user", "content": opening},
        *(item.model_dump(exclude_none=True) for item in first.parse().output),
        {"role": "user", "content": follow_up},
    ]
    alone = {k: v for k, v in asked.items() if k != "conversation"}
    assert second.parse().output_text == engine_alone_text(local_pair, {**alone, "input": history})


def test_chained_state_survives_a_gateway_restart_with_redis(local_pair: LocalPair) -> None:
    """Responses stored in Redis outlive the gateway that stored them: a new gateway chains to
    one, and answers as one engine alone would with the whole history."""
    with running_redis() as redis:
        config = GatewayConfig(
            prefill=endpoints([local_pair.prefill_url]),
            decode=endpoints([local_pair.decode_url], [local_pair.decode_control_url]),
            control_secret=local_pair.control_secret,
            state=redis.url,
        )
        asked = {
            "model": local_pair.model, "instructions": INSTRUCTIONS,
            "max_output_tokens": MAX_TOKENS, "temperature": 0,
        }  # fmt: skip
        opening = long_prompt(800, f"lighthouse {uuid.uuid4()}")
        with running_gateway(config) as before:
            client = openai.OpenAI(base_url=before.url + "/v1", api_key="-", max_retries=0)
            first = client.responses.create(input=opening, **asked)
        follow_up = "Tool result: the lamp was replaced. " * 3
        with running_gateway(config) as after:
            client = openai.OpenAI(base_url=after.url + "/v1", api_key="-", max_retries=0)
            second = client.responses.create(
                input=follow_up, previous_response_id=first.id, **asked
            )
        history = [
            {"role": "user", "content": opening},
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"role": "user", "content": follow_up},
        ]
        assert second.output_text == engine_alone_text(local_pair, {**asked, "input": history})
        assert second.usage is not None and second.usage.input_tokens > 800
