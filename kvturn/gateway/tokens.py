"""The exact token ids of a turn's prompt, from the engine's own tokenizer and chat template.

vLLM's ``/tokenize`` renders chat messages with the same template, tools and options a chat
completion would, so the ids are the ones the engine will see. The planner needs them only for
a conversation whose KV a decode holds (to know the suffix, and whether the prompt still starts
with what the holder retains), and only while planning a turn that does not provably extend
the held one (those are planned from a bound and counted after their reply: see
:mod:`.extension`); it asks an idle prefill engine's API server, else the holder's (every
engine of a deployment serves the same model and template; the API server tokenizes outside
the engine loop). Cost, measured in ``benchmarks/results/turn_ttft.md``.
"""

from __future__ import annotations

import logging
from typing import Any

from kvturn.gateway.http.upstream import Upstream, UpstreamUnavailable

logger = logging.getLogger("kvturn.gateway")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: Chat request fields that change how the prompt is rendered.
CHAT_RENDER_FIELDS = (
    "model",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)
#: A planning aid: never worth waiting long for.
TOKENIZE_TIMEOUT_S = 2.0


async def prompt_token_ids(
    upstream: Upstream, engine_url: str, path: str, body: dict[str, Any]
) -> list[int] | None:
    """The prompt's token ids as ``engine_url`` tokenizes them; ``None`` if it cannot say."""
    if path == CHAT_PATH:
        request = {k: body[k] for k in CHAT_RENDER_FIELDS if k in body}
        request["messages"] = body.get("messages")
    elif path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt  # already token ids
        if not isinstance(prompt, str):
            return None
        request = {"prompt": prompt}
        for name in ("model", "add_special_tokens"):
            if name in body:
                request[name] = body[name]
    else:
        return None
    try:
        response = await upstream.post_json(
            engine_url + "/tokenize", request, timeout_s=TOKENIZE_TIMEOUT_S
        )
    except UpstreamUnavailable as error:
        logger.debug("tokenize on %s failed: %s", engine_url, error)
        return None
    if response.status != 200:
        logger.debug("tokenize on %s answered %s", engine_url, response.status)
        return None
    tokens = response.json().get("tokens")
    return tokens if isinstance(tokens, list) else None


async def detokenized(
    upstream: Upstream, engine_url: str, model: Any, ids: list[int]
) -> str | None:
    """The text of ``ids`` as ``engine_url``'s tokenizer decodes it; ``None`` if it cannot say."""
    try:
        response = await upstream.post_json(
            engine_url + "/detokenize",
            {"model": model, "tokens": ids},
            timeout_s=TOKENIZE_TIMEOUT_S,
        )
    except UpstreamUnavailable as error:
        logger.debug("detokenize on %s failed: %s", engine_url, error)
        return None
    text = response.json().get("prompt") if response.status == 200 else None
    return text if isinstance(text, str) else None
