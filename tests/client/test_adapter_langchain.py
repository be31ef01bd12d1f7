"""The LangChain/LangGraph adapter, through a real LangGraph tool loop.

Takes ``base_url``: the stand-in gateway by default, the real one with KVTURN_TEST_BASE_URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from kvturn_test_helpers import REUSE_PLANS, assert_reuse_and_pause_kinds
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from kvturn.client import AsyncOpenAI, OpenAI, current_conversation
from kvturn.client.adapters.langchain import (
    KvturnChatOpenAI,
    arelease_thread,
    chat_openai,
    release_thread,
)

SEEN: list[Any] = []

#: The stand-in, and the real gateway on the session's 1P1D engine pair.
BOTH_GATEWAYS = ["stand-in", pytest.param("engines", marks=pytest.mark.engines)]


#: Room for the forced call's whole ``<tool_call>`` envelope (the tiny test model's tokenizer
#: spends about one token per character).
MAX_TOKENS = 128


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo", "Bergen"]) -> str:
    """Weather in a city."""
    SEEN.append(current_conversation())
    return f"sunny in {city}"


@pytest.fixture
def llm(
    base_url: str, model_name: str, request: pytest.FixtureRequest
) -> Iterator[KvturnChatOpenAI]:
    SEEN.clear()
    client = OpenAI(base_url=base_url, api_key="test", max_retries=0)
    async_client = AsyncOpenAI(base_url=base_url, api_key="test", max_retries=0)
    yield chat_openai(
        client, async_client, model=model_name, temperature=0, max_tokens=MAX_TOKENS,
        streaming=request.param if hasattr(request, "param") else False,
    )  # fmt: skip
    client.close()


def build_graph(llm: KvturnChatOpenAI) -> Any:
    # The tool is forced while the last message is the user's (a random-weight model must
    # still call it); after a tool result the model answers, the tool still offered (as agents
    # do: the same tools on every call keep the prompt's prefix, and so its KV, the same).
    # Strict, with an enum: vLLM pins a forced call's arguments to the schema only for strict
    # tools.
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    answer = llm.bind_tools([get_weather], tool_choice="none", strict=True)

    def agent(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        model = answer if isinstance(last, ToolMessage) else forced
        return {"messages": [model.invoke(state["messages"])]}

    async def aagent(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        model = answer if isinstance(last, ToolMessage) else forced
        return {"messages": [await model.ainvoke(state["messages"])]}

    from langchain_core.runnables import RunnableLambda

    graph = StateGraph(MessagesState)
    graph.add_node("agent", RunnableLambda(agent, afunc=aagent))
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("llm", [False, True], ids=["invoke", "streamed"], indirect=True)
@pytest.mark.parametrize("gateway_kind", BOTH_GATEWAYS, indirect=True)
def test_two_turn_graph_run_reuses_kv_on_turn_2(llm: KvturnChatOpenAI, real_gateway: bool) -> None:
    graph = build_graph(llm)
    config = {"configurable": {"thread_id": "thread-7"}}
    graph.invoke({"messages": [("user", "Weather in Paris?")]}, config)
    graph.invoke({"messages": [("user", "And in Rome?")]}, config)

    assert isinstance(llm.root_client, OpenAI)
    conversation = llm.root_client.kvturn_conversations["thread-7"]
    assert_reuse_and_pause_kinds(conversation.turns)
    assert all(turn.plan in REUSE_PLANS for turn in conversation.turns[1:])
    # Tools run between model calls, outside any scope; the pause still counts as a tool pause.
    assert [None] * sum(t.tool_calls for t in conversation.turns) == SEEN
    assert len(conversation.turns) == 4 and len(SEEN) == 2  # the tool ran for each question
    assert [t.pause.kind if t.pause else None for t in conversation.turns] == [
        None,
        "tool",
        "user",
        "tool",
    ]

    release_thread(llm, "thread-7")
    assert "thread-7" not in llm.root_client.kvturn_conversations


@pytest.mark.parametrize("gateway_kind", BOTH_GATEWAYS, indirect=True)
async def test_async_graph_run_reuses_kv_on_turn_2(
    llm: KvturnChatOpenAI, real_gateway: bool
) -> None:
    graph = build_graph(llm)
    config = {"configurable": {"thread_id": "thread:async/1"}}  # any id is taken as it is
    await graph.ainvoke({"messages": [("user", "Weather in Paris?")]}, config)
    await graph.ainvoke({"messages": [("user", "And in Rome?")]}, config)

    assert isinstance(llm.root_async_client, AsyncOpenAI)
    (conversation,) = llm.root_async_client.kvturn_conversations.values()
    assert conversation.id == "thread:async/1"
    assert_reuse_and_pause_kinds(conversation.turns)
    assert len(conversation.turns) == 4 and len(SEEN) == 2  # the tool ran for each question
    await arelease_thread(llm, "thread:async/1")
    assert not llm.root_async_client.kvturn_conversations
    await llm.root_async_client.close()


def test_streaming_calls_and_an_outer_conversation(llm: KvturnChatOpenAI) -> None:
    assert isinstance(llm.root_client, OpenAI)
    with llm.root_client.conversation("outer") as conversation:
        chunks = list(llm.stream("hello", config={"configurable": {"thread_id": "ignored"}}))
        llm.invoke("again")
    assert chunks
    assert conversation.turn_count == 2  # the outer conversation wins over the thread id
    assert conversation.turns[1].pause is not None
    assert "ignored" not in llm.root_client.kvturn_conversations
