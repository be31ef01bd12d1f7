"""kvturn for the OpenAI Agents SDK (install ``kvturn[agents]``).

A run is one user turn of a longer conversation, so a run's conversation stays open after
the run (heartbeats go on up to the client's ``max_pause_seconds``) and the next run with the
same session resumes it; :meth:`AsyncOpenAI.release_conversation` ends it. The conversation id
comes from the run: its ``conversation_id``, else its session's ``session_id``, else the run
config's ``group_id``, else a new uuid4. Tool start/end hooks mark the pauses they cause as
tool pauses, whatever API the model is called through (the SDK's default Responses model,
:func:`responses_model`, or :func:`chat_completions_model`)::

    client = kvturn.client.AsyncOpenAI(base_url=..., api_key=...)
    agent = Agent(name="a", tools=[...], model=responses_model(client, "my-model"))
    result = await run(client, agent, "hi", session=SQLiteSession("user-42"))
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    RunHooks,
    Runner,
    RunResult,
    Session,
)
from agents.items import ModelResponse, TResponseInputItem
from agents.run_context import RunContextWrapper
from agents.tool import Tool

from .._client import AsyncConversationScope, AsyncOpenAI
from .._conversation import current_conversation
from .._headers import conversation_id_from

__all__ = [
    "KvturnRunHooks",
    "chat_completions_model",
    "conversation_for_run",
    "conversation_id_for_run",
    "responses_model",
    "run",
]


class KvturnRunHooks(RunHooks[Any]):
    """Run hooks that report tool starts and ends to the current kvturn conversation, then
    forward every event to ``inner`` (the caller's own hooks), if any."""

    def __init__(self, inner: RunHooks[Any] | None = None) -> None:
        self.inner = inner

    async def on_tool_start(self, context: RunContextWrapper[Any], agent: Any, tool: Tool) -> None:
        conversation = current_conversation()
        if conversation is not None:
            conversation.tool_started()
        if self.inner is not None:
            await self.inner.on_tool_start(context, agent, tool)

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Any, tool: Tool, result: object
    ) -> None:
        conversation = current_conversation()
        if conversation is not None:
            conversation.tool_finished()
        if self.inner is not None:
            await self.inner.on_tool_end(context, agent, tool, result)

    async def on_llm_start(
        self,
        context: RunContextWrapper[Any],
        agent: Agent[Any],
        system_prompt: str | None,
        input_items: list[TResponseInputItem],
    ) -> None:
        if self.inner is not None:
            await self.inner.on_llm_start(context, agent, system_prompt, input_items)

    async def on_llm_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], response: ModelResponse
    ) -> None:
        if self.inner is not None:
            await self.inner.on_llm_end(context, agent, response)

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        if self.inner is not None:
            await self.inner.on_agent_start(context, agent)

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        if self.inner is not None:
            await self.inner.on_agent_end(context, agent, output)

    async def on_handoff(
        self, context: RunContextWrapper[Any], from_agent: Any, to_agent: Any
    ) -> None:
        if self.inner is not None:
            await self.inner.on_handoff(context, from_agent, to_agent)


def conversation_id_for_run(
    *,
    conversation_id: str | None = None,
    session: Session | None = None,
    run_config: RunConfig | None = None,
) -> str | None:
    """The kvturn conversation id of a run: its conversation, session or group id (as it is,
    or a digest of one no conversation id can be: :func:`~kvturn.client.conversation_id_from`),
    or ``None`` when the run has none of them."""
    for candidate in (
        conversation_id,
        getattr(session, "session_id", None),
        run_config.group_id if run_config is not None else None,
    ):
        if candidate:
            return conversation_id_from(str(candidate))
    return None


def conversation_for_run(
    client: AsyncOpenAI,
    *,
    conversation_id: str | None = None,
    session: Session | None = None,
    run_config: RunConfig | None = None,
    release: bool = False,
) -> AsyncConversationScope:
    """The conversation scope for a run; wrap ``Runner.run_streamed`` consumption in it."""
    cid = conversation_id_for_run(
        conversation_id=conversation_id, session=session, run_config=run_config
    )
    return client.conversation(cid, release=release)


def chat_completions_model(client: AsyncOpenAI, model: str) -> OpenAIChatCompletionsModel:
    """An Agents SDK model that calls chat completions through the kvturn client (the API a
    vLLM gateway serves)."""
    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def responses_model(client: AsyncOpenAI, model: str) -> OpenAIResponsesModel:
    """The SDK's default model (the Responses API) through the kvturn client; the gateway
    serves ``/v1/responses`` on the same turn path as chat completions."""
    return OpenAIResponsesModel(model=model, openai_client=client)


async def run(
    client: AsyncOpenAI,
    starting_agent: Agent[Any],
    input: Any,
    *,
    conversation_id: str | None = None,
    session: Session | None = None,
    run_config: RunConfig | None = None,
    hooks: RunHooks[Any] | None = None,
    release: bool = False,
    **kwargs: Any,
) -> RunResult:
    """``Runner.run`` inside the run's kvturn conversation, with tool hooks installed.

    ``conversation_id``, ``session`` and ``run_config`` are passed on to ``Runner.run``
    unchanged; ``release=True`` ends the conversation with the run.
    """
    async with conversation_for_run(
        client,
        conversation_id=conversation_id,
        session=session,
        run_config=run_config,
        release=release,
    ):
        return await Runner.run(
            starting_agent,
            input,
            conversation_id=conversation_id,
            session=session,
            run_config=run_config,
            hooks=KvturnRunHooks(hooks),
            **kwargs,
        )
