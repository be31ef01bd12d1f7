"""The request headers that tell the gateway which conversation and turn a request is."""

from __future__ import annotations

import hashlib
import os
import random
import uuid

from kvturn.headers import (
    CONVERSATION_ID,
    HEARTBEATS,
    PAUSE_KIND,
    PAUSE_MS,
    TURN_ID,
    conversation_id_header,
    is_valid_conversation_id,
)

from ._pauses import Pause

__all__ = ["conversation_id_from", "new_conversation_id", "new_turn_id", "turn_headers"]


def new_conversation_id() -> str:
    """A fresh random conversation id."""
    return str(uuid.uuid4())


# Turn ids need uniqueness, not secrecy: a seeded PRNG costs well under a microsecond, where
# os.urandom is a system call (~10 us on some sandboxes). Reseeded in forked children so
# processes never share a sequence.
_turn_rng = random.Random(os.urandom(32))


def _reseed_after_fork() -> None:
    _turn_rng.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed_after_fork)


def new_turn_id() -> str:
    """A fresh random turn id: 32 hex digits, opaque to the gateway."""
    return f"{_turn_rng.getrandbits(128):032x}"


def conversation_id_from(value: str) -> str:
    """``value`` if it is a valid conversation id (any string of 1 to 1,024 bytes of UTF-8
    without control characters: :func:`kvturn.headers.conversation_id_problem`), else a stable
    digest of it: an empty, longer or control-character id still maps to one conversation."""
    if is_valid_conversation_id(value):
        return value
    return "h-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def turn_headers(
    conversation_id: str, turn_id: str, pause: Pause | None, heartbeats: bool = False
) -> dict[str, str]:
    """Headers of one turn; the pause ones only when a pause preceded it, the heartbeat one
    when the client beats through the pause after it."""
    headers = {CONVERSATION_ID: conversation_id_header(conversation_id), TURN_ID: turn_id}
    if heartbeats:
        headers[HEARTBEATS] = "on"
    if pause is not None:
        headers[PAUSE_MS] = str(pause.ms)
        headers[PAUSE_KIND] = pause.kind
    return headers
