"""A turn that extends the held prompt: a bound on its new tokens, without counting them.

An agent's next turn is almost always its previous request's messages, the reply, and what is
new (a tool result, a user reply). The holder decode's prefix cache then serves the previous
prompt, and computes only what the new messages render to. Counting that exactly means
rendering and tokenizing the whole history on an engine's API server while the turn waits
(``/tokenize``: 3 to 6 ms at 2k to 8k tokens here, 5 to 10% of a decode-local turn's time to
first token, most of its distance from a single engine's; ``benchmarks/results/turn_ttft.md``).
A bound is enough to plan by:

* the request provably extends the held turn's request: its first ``n`` messages digest to what
  the held turn's ``n`` messages digested to (the chain of :mod:`.digests`: one pass over
  the messages, which the gateway makes anyway), and the fields that decide how a prompt
  renders (model, tools, template and its options) are the same;
* then what the holder computes is at most the held tokens past the verified prefix (which
  stops :data:`BOUNDARY_TOKENS` short of the held prompt's end), plus the tokens of messages
  ``n`` onwards (the previous reply included: re-rendered from text, it need
  not come back as the tokens decode generated) and the generation prompt;
* and a message renders to at most one token per byte of its JSON plus a template's wrapper
  (:data:`MESSAGE_OVERHEAD_TOKENS`): every token of a byte-level BPE vocabulary, or of a
  SentencePiece one with byte fallback, stands for at least one byte of text, and a message's
  JSON holds each of its fields' text (escaped, never shorter), its keys and quotes besides.
  Content that is not text (an image, audio) renders to many tokens from few bytes: no bound.

The bound rests on one assumption: that the chat template renders a longer message list as an
extension of the shorter one's rendering, as the common templates do. The gateway checks it
after the reply (see ``TurnRunner._count_after``): the prompt is counted then, off the
response path, and a bound that did not hold turns this shortcut off for the gateway.
Correctness never rests on it: the holder's prefix cache matches exact token ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson

from kvturn.gateway.tokens import CHAT_RENDER_FIELDS

#: The last tokens of a prompt that text appended to it may merge with into other tokens: the
#: last pre-token of a byte-level BPE (ChatML's "\n" after ``assistant`` merges with a reply's
#: leading space in SmolLM2's vocabulary). What verifies a history stops short of them.
BOUNDARY_TOKENS = 8
#: What a chat template may add around one message (role header, separators, tool-call
#: wrappers, a tool result's name), in tokens: generous.
MESSAGE_OVERHEAD_TOKENS = 64
#: What it may add after the last message (the generation prompt).
GENERATION_OVERHEAD_TOKENS = 32


def render_digest(body: dict[str, Any]) -> str:
    """A digest of the request fields, other than the messages, that decide its prompt."""
    fields = {k: body[k] for k in CHAT_RENDER_FIELDS if k in body}
    encoded = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(encoded, digest_size=8).hexdigest()


def prompt_mark(body: dict[str, Any], digests: Sequence[bytes]) -> str | None:
    """What a chat request's prompt is recognised by next turn: its message count, the
    digest of its messages (``digests[-1]``, :func:`~.digests.message_digests`) and of the
    fields that render them. ``None`` for a request without messages."""
    if not digests:
        return None
    return f"{len(digests)}:{digests[-1].hex()}:{render_digest(body)}"


def new_tokens_bound(
    body: dict[str, Any], digests: Sequence[bytes], mark: str | None
) -> int | None:
    """At most how many tokens the request adds to the prompt ``mark`` recognises (its
    messages past that prompt's, and the generation prompt); ``None`` if the request does
    not provably extend it, or what it adds has no bound by size."""
    if mark is None:
        return None
    try:
        count_text, digest, rendered = mark.split(":")
        count = int(count_text)
    except ValueError:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < count < len(messages) or count > len(digests):
        return None
    if digests[count - 1].hex() != digest or render_digest(body) != rendered:
        return None
    return messages_bound(messages[count:])


def messages_bound(messages: Sequence[Any]) -> int | None:
    """At most how many tokens ``messages`` render to after a prompt, with the generation
    prompt; ``None`` if a message holds content that is not text."""
    total = GENERATION_OVERHEAD_TOKENS
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list) and not all(
            isinstance(part, dict) and part.get("type") == "text" for part in content
        ):
            return None
        if content is not None and not isinstance(content, (str, list)):
            return None
        try:
            total += len(orjson.dumps(message)) + MESSAGE_OVERHEAD_TOKENS
        except (orjson.JSONEncodeError, TypeError):
            return None
    return total
