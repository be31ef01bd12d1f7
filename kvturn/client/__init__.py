"""kvturn.client: drop-in OpenAI clients that keep a conversation's KV cache alive between turns.

Inside ``client.conversation()`` every request carries the conversation id, a turn id stable
across the SDK's retries and the pause before the turn; during pauses the client renews the
conversation's lease through the gateway, and leaving the scope releases it::

    from kvturn.client import OpenAI

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    with client.conversation() as conversation:
        reply = client.chat.completions.create(model=..., messages=..., tools=...)
"""

from ._client import AsyncConversationScope, AsyncOpenAI, ConversationScope, OpenAI
from ._clock import Clock
from ._conversation import Conversation, Turn, current_conversation
from ._headers import conversation_id_from
from ._pauses import Pause
from ._settings import DEFAULT_LEASE_SECONDS, DEFAULT_MAX_PAUSE_SECONDS, KvturnSettings

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_PAUSE_SECONDS",
    "AsyncConversationScope",
    "AsyncOpenAI",
    "Clock",
    "Conversation",
    "ConversationScope",
    "KvturnSettings",
    "OpenAI",
    "Pause",
    "Turn",
    "conversation_id_from",
    "current_conversation",
]
