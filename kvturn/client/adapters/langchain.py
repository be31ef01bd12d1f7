"""kvturn for LangChain and LangGraph (install ``kvturn[langchain]``).

:func:`chat_openai` builds a ``ChatOpenAI`` on kvturn clients. Each model call runs in the
kvturn conversation named by the LangGraph ``thread_id`` of the run it belongs to (or by
``kvturn_conversation_id``), unless the caller already opened a conversation. A thread is a
long conversation, so it stays open between graph runs (heartbeats go on up to the client's
``max_pause_seconds``); :func:`release_thread` ends it::

    llm = chat_openai(OpenAI(base_url=..., api_key=...), model="my-model")
    graph = build_graph(llm.bind_tools(tools))  # ToolNode etc. as usual
    graph.invoke({"messages": [...]}, {"configurable": {"thread_id": "t-1"}})
    release_thread(llm, "t-1")
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables.config import ensure_config
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from .._client import AsyncOpenAI, OpenAI
from .._conversation import current_conversation
from .._headers import conversation_id_from

__all__ = ["KvturnChatOpenAI", "arelease_thread", "chat_openai", "release_thread"]


def _thread_id(run_manager: Any) -> str | None:
    # LangGraph copies configurable scalars (thread_id among them) into the run's metadata;
    # the ambient config covers models called outside a graph with a thread_id of their own.
    metadata = getattr(run_manager, "metadata", None) or {}
    value = metadata.get("thread_id")
    if value is None:
        value = ensure_config().get("configurable", {}).get("thread_id")
    return None if value is None else str(value)


class KvturnChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` whose calls belong to the kvturn conversation of their thread."""

    #: A fixed conversation id, instead of the LangGraph thread id.
    kvturn_conversation_id: str | None = None

    def _kvturn_id(self, run_manager: Any) -> str | None:
        if current_conversation() is not None:
            return None  # the caller opened one: requests already belong to it
        raw = self.kvturn_conversation_id or _thread_id(run_manager)
        return None if raw is None else conversation_id_from(raw)

    def _scope(self, run_manager: Any) -> contextlib.AbstractContextManager[Any]:
        cid = self._kvturn_id(run_manager)
        if cid is None or not isinstance(self.root_client, OpenAI):
            return contextlib.nullcontext()
        return self.root_client.conversation(cid, release=False)

    def _ascope(self, run_manager: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        cid = self._kvturn_id(run_manager)
        if cid is None or not isinstance(self.root_async_client, AsyncOpenAI):
            return contextlib.nullcontext()
        return self.root_async_client.conversation(cid, release=False)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with self._scope(run_manager):
            return super()._generate(messages, stop, run_manager, **kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        async with self._ascope(run_manager):
            return await super()._agenerate(messages, stop, run_manager, **kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with self._scope(run_manager):
            yield from super()._stream(messages, stop, run_manager, **kwargs)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async with self._ascope(run_manager):
            async for chunk in super()._astream(messages, stop, run_manager, **kwargs):
                yield chunk


def chat_openai(
    client: OpenAI | None = None,
    async_client: AsyncOpenAI | None = None,
    **kwargs: Any,
) -> KvturnChatOpenAI:
    """A ``ChatOpenAI`` (``KvturnChatOpenAI``) on kvturn clients.

    Give either client or both; a missing one is made with the other's base URL, key and kvturn
    settings. ``kwargs`` are ``ChatOpenAI``'s (``model``, ``temperature``, ...).
    """
    if client is None and async_client is None:
        raise ValueError("chat_openai needs a kvturn OpenAI or AsyncOpenAI client")
    if client is None:
        assert async_client is not None
        client = OpenAI(
            base_url=str(async_client.base_url),
            api_key=async_client.api_key,
            kvturn_settings=async_client.kvturn_settings,
        )
    if async_client is None:
        async_client = AsyncOpenAI(
            base_url=str(client.base_url),
            api_key=client.api_key,
            kvturn_settings=client.kvturn_settings,
        )
    return KvturnChatOpenAI(
        client=client.chat.completions,
        root_client=client,
        async_client=async_client.chat.completions,
        root_async_client=async_client,
        base_url=str(client.base_url),
        api_key=SecretStr(client.api_key),
        **kwargs,
    )


def release_thread(llm: KvturnChatOpenAI, thread_id: str) -> None:
    """End the kvturn conversation of a thread that was called synchronously."""
    if isinstance(llm.root_client, OpenAI):
        llm.root_client.release_conversation(conversation_id_from(thread_id))


async def arelease_thread(llm: KvturnChatOpenAI, thread_id: str) -> None:
    """End the kvturn conversation of a thread that was called asynchronously."""
    if isinstance(llm.root_async_client, AsyncOpenAI):
        await llm.root_async_client.release_conversation(conversation_id_from(thread_id))
