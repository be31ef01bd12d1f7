"""The OpenAI Agents SDK adapter, through a real Agents SDK run.

Takes ``base_url``: the stand-in gateway by default, the real one with KVTURN_TEST_BASE_URL.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import pytest
import pytest_asyncio
from agents import (
    Agent,
    ModelSettings,
    RunConfig,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from kvturn_test_helpers import (
    REUSE_PLANS,
    assert_reuse_and_pause_kinds,
    assert_tool_ran_per_question,
)

from kvturn.client import AsyncOpenAI, Conversation, current_conversation
from kvturn.client._conversation import begin_turn, finish_turn
from kvturn.client.adapters.openai_agents import (
    KvturnRunHooks,
    chat_completions_model,
    conversation_for_run,
    conversation_id_for_run,
    responses_model,
    run,
)

set_tracing_disabled(True)  # no trace export: nothing outside the test may be reached

#: The stand-in, and the real gateway on the session's 1P1D engine pair.
BOTH_GATEWAYS = ["stand-in", pytest.param("engines", marks=pytest.mark.engines)]


@pytest_asyncio.fixture(loop_scope="function")
async def client(base_url: str) -> AsyncIterator[AsyncOpenAI]:
    client = AsyncOpenAI(base_url=base_url, api_key="test", max_retries=0)
    yield client
    await client.close()


#: Room for the forced call's whole ``<tool_call>`` envelope (the tiny test model's tokenizer
#: spends about one token per character).
MAX_TOKENS = 128


def weather_agent(client: AsyncOpenAI, model: str, seen: list[Conversation | None]) -> Agent:
    # A strict schema (the SDK's default) with an enum: vLLM pins a forced call's arguments to
    # the schema only for strict tools (otherwise it constrains the call's envelope alone), and
    # a random-weight model's free strings would run on to max_tokens.
    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo", "Bergen"]) -> str:
        """Weather in a city."""
        seen.append(current_conversation())
        return f"sunny in {city}"

    return Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        # Forced on the first call so even a random-weight model calls the tool; the SDK
        # resets tool_choice after a tool call, so the second call answers.
        model_settings=ModelSettings(
            tool_choice="get_weather", temperature=0.0, max_tokens=MAX_TOKENS
        ),
        model=chat_completions_model(client, model),
    )


@pytest.mark.parametrize("gateway_kind", BOTH_GATEWAYS, indirect=True)
async def test_two_turn_run_reuses_kv_on_turn_2(
    client: AsyncOpenAI, model_name: str, real_gateway: bool
) -> None:
    seen: list[Conversation | None] = []
    session = SQLiteSession("user-42")
    agent = weather_agent(client, model_name, seen)

    # Two user turns of one session: the model calls the tool (a tool pause, then the answer)
    # and answers, then the next question comes after a user pause.
    await run(client, agent, "Weather in Paris?", session=session)
    await run(client, agent, "And in Rome?", session=session)
    conversation = client.kvturn_conversations["user-42"]
    assert_reuse_and_pause_kinds(conversation.turns)
    assert all(turn.plan in REUSE_PLANS for turn in conversation.turns[1:])
    assert seen == [conversation] * sum(t.tool_calls for t in conversation.turns)
    assert conversation.tools_running == 0  # start and end hooks both reached it
    # The tool ran once per question, and each ran in a tool pause between two model calls.
    assert len(seen) == 2
    assert [t.pause.kind if t.pause else None for t in conversation.turns] == [
        None,
        "tool",
        "user",
        "tool",
    ]

    await client.release_conversation("user-42")
    assert "user-42" not in client.kvturn_conversations


@pytest.mark.parametrize("gateway_kind", BOTH_GATEWAYS, indirect=True)
async def test_streamed_run_inside_its_conversation(
    client: AsyncOpenAI, model_name: str, real_gateway: bool
) -> None:
    seen: list[Conversation | None] = []
    agent = weather_agent(client, model_name, seen)
    config = RunConfig(group_id="group 7/x", tracing_disabled=True)
    async with conversation_for_run(client, run_config=config, release=True) as conversation:
        for question in ("Weather in Oslo?", "And in Bergen?"):
            streamed = Runner.run_streamed(
                agent, question, run_config=config, hooks=KvturnRunHooks()
            )
            async for _ in streamed.stream_events():
                pass
    assert conversation.id == conversation_id_for_run(run_config=config)
    assert conversation.id == "group 7/x"  # any id travels as it is (issue 40)
    assert_reuse_and_pause_kinds(conversation.turns)
    assert seen == [conversation] * sum(t.tool_calls for t in conversation.turns)
    # The tool ran for each question, streamed (what the model does after it, unforced, varies).
    assert_tool_ran_per_question(conversation.turns, questions=2)
    assert len(seen) >= 2
    if real_gateway:
        assert all(turn.plan in REUSE_PLANS for turn in conversation.turns[1:])
    assert conversation.released


def test_conversation_id_precedence() -> None:
    session = SQLiteSession("sess-1")
    config = RunConfig(group_id="grp-1")
    assert conversation_id_for_run(conversation_id="conv_9", session=session) == "conv_9"
    assert conversation_id_for_run(session=session, run_config=config) == "sess-1"
    assert conversation_id_for_run(run_config=config) == "grp-1"
    assert conversation_id_for_run() is None


async def test_tool_hooks_mark_a_tool_pause_and_forward(client: AsyncOpenAI) -> None:
    calls: list[str] = []

    class Inner(KvturnRunHooks):
        async def on_tool_start(self, context, agent, tool) -> None:  # type: ignore[no-untyped-def]
            calls.append("start")

        async def on_tool_end(self, context, agent, tool, result) -> None:  # type: ignore[no-untyped-def]
            calls.append("end")

    hooks = KvturnRunHooks(Inner())
    async with client.conversation(release=False) as conversation:
        finish_turn(begin_turn(conversation), False)  # a reply that said nothing of tools
        await hooks.on_tool_start(None, None, None)  # type: ignore[arg-type]
        assert conversation.tools_running == 1
        await hooks.on_tool_end(None, None, None, "ok")  # type: ignore[arg-type]
        assert conversation.tools_running == 0
        pause = conversation.current_pause()
    assert pause is not None and pause.kind == "tool"
    assert calls == ["start", "end"]


@pytest.mark.engines
async def test_default_responses_model_reuses_and_answers_as_one_engine_alone(
    local_pair: Any,
) -> None:
    """The SDK's default model (the Responses API) through the real gateway: the tool runs,
    model calls after the first reuse KV, and every call's output equals one engine alone
    (vLLM's own ``/v1/responses``, fresh cache salt) answering the very request sent."""
    sent: list[dict[str, Any]] = []
    answered: list[dict[str, Any]] = []

    async def on_request(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(request.content))

    async def on_response(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/responses"):
            answered.append(json.loads(await response.aread()))

    http = httpx.AsyncClient(event_hooks={"request": [on_request], "response": [on_response]})
    client = AsyncOpenAI(
        base_url=local_pair.gateway_url,
        api_key="test",
        max_retries=0,
        http_client=http,
    )
    seen: list[Conversation | None] = []
    # Each question ends with its tool's result: the SDK fails a run on a response that stopped
    # at max_output_tokens ("incomplete"), and a random-weight model's unforced answer never
    # stops by itself (a stop string would end it, but vLLM aborts a request that hits one,
    # and an aborted request keeps no KV for the next turn). Even a forced call can run on
    # (vLLM's JSON grammar allows whitespace after the arguments): these two questions are
    # ones the seeded test model's forced calls end on ("Weather in Oslo?" then "And in
    # Bergen?" is one they do not).
    agent = weather_agent(client, local_pair.model, seen).clone(
        model=responses_model(client, local_pair.model), tool_use_behavior="stop_on_first_tool"
    )
    session = SQLiteSession("responses-run-1")  # the SDK sends the whole history each call
    try:
        first = await run(client, agent, "Weather in Paris?", session=session)
        second = await run(client, agent, "And in Rome?", session=session)
        assert first.final_output.startswith("sunny in ")  # the tool's own result
        assert second.final_output.startswith("sunny in ")
        conversation = client.kvturn_conversations["responses-run-1"]
        assert_reuse_and_pause_kinds(conversation.turns)
        assert [t.tool_calls for t in conversation.turns] == [True, True]
        assert seen == [conversation, conversation]  # the tool ran once per question
        assert len(sent) == len(answered) == len(conversation.turns)
        async with httpx.AsyncClient(timeout=300) as engine:
            for i, (body, got) in enumerate(zip(sent, answered, strict=True)):
                alone = {**body, "store": False, "cache_salt": uuid.uuid4().hex}
                url = f"{local_pair.prefill_url}/v1/responses"  # vLLM's own Responses server
                want = await engine.post(url, json=alone)
                want.raise_for_status()
                expected = want.json()
                assert _output_of(got) == _output_of(expected), f"model call {i + 1}"
        await client.release_conversation("responses-run-1")
    finally:
        await client.close()
        await http.aclose()


def _output_of(response: dict[str, Any]) -> list[tuple[str, ...]]:
    """A response's output as what the model said: texts, and calls by name and arguments."""
    said: list[tuple[str, ...]] = []
    for item in response["output"]:
        if item["type"] == "message":
            said.append(("text", "".join(part.get("text", "") for part in item["content"])))
        elif item["type"] == "function_call":
            said.append(("call", item["name"], item["arguments"]))
    return said
