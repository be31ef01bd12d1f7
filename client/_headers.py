"""The request headers that tell the gateway which conversation and turn a request is."""

from __future__ import annotations

import hashlib
import os
import random
import uuid
from typing import Final

from kvturn.headers import (
    CONVERSATION_ID,
    PAUSE_KIND,
    PAUSE_MS,
    TURN_ID,
    is_valid_conversation_id,
)

from ._pauses import Pause

__all__ = [
    "HeaderItem",
    "conversation_id_from",
    "header_item",
    "new_conversation_id",
    "new_turn_id",
    "refill_turn_ids",
    "turn_headers",
    "turn_id_pool",
]

#: One header as httpx/httpx2 keep it: (name, lower-case name, value), all ASCII bytes.
HeaderItem = tuple[bytes, bytes, bytes]


def header_item(name: str, value: str) -> HeaderItem:
    """``name: value`` in httpx's raw form."""
    key = name.encode("ascii")
    return (key, key.lower(), value.encode("ascii"))


#: The lower-case names of every turn header, to find them among a request's headers.
TURN_HEADER_KEYS: Final = frozenset(
    name.lower().encode("ascii") for name in (CONVERSATION_ID, TURN_ID, PAUSE_MS, PAUSE_KIND)
)
PAUSE_MS_KEY: Final = PAUSE_MS.encode("ascii")
PAUSE_MS_LOWER: Final = PAUSE_MS.lower().encode("ascii")
#: The pause-kind header has two possible values: both items are made once.
PAUSE_KIND_ITEMS: Final = {
    "tool": header_item(PAUSE_KIND, "tool"),
    "user": header_item(PAUSE_KIND, "user"),
}


def new_conversation_id() -> str:
    """A fresh random conversation id."""
    return str(uuid.uuid4())


# Turn ids need uniqueness, not secrecy: a seeded PRNG costs well under a microsecond, where
# os.urandom is a system call (~10 us on some sandboxes). Reseeded in forked children so
# processes never share a sequence.
_turn_rng = random.Random(os.urandom(32))

#: Turn ids made ahead, as their header items, popped one per turn. Making one (random bits,
#: hex formatting, encoding) amid the SDK's work, with cold caches, costs several microseconds;
#: a batch made at once costs a fraction of that per id. ``list.pop`` is atomic, so threads
#: never get the same id; a thread finding the list empty makes a batch of its own.
TURN_ID_BATCH = 64
turn_id_pool: list[HeaderItem] = []


def refill_turn_ids() -> None:
    """Add a batch of fresh turn ids to :data:`turn_id_pool`."""
    key, lower = TURN_ID.encode("ascii"), TURN_ID.lower().encode("ascii")
    digits = _turn_rng.randbytes(16 * TURN_ID_BATCH).hex().encode("ascii")  # 32 per id
    turn_id_pool.extend([(key, lower, digits[i : i + 32]) for i in range(0, len(digits), 32)])


def _after_fork_in_child() -> None:
    _turn_rng.seed(os.urandom(32))
    turn_id_pool.clear()  # the parent may use these


os.register_at_fork(after_in_child=_after_fork_in_child)


def new_turn_id() -> str:
    """A fresh random turn id: 32 hex digits, opaque to the gateway."""
    try:
        return turn_id_pool.pop()[2].decode("ascii")
    except IndexError:
        refill_turn_ids()
        return turn_id_pool.pop()[2].decode("ascii")


def conversation_id_from(value: str) -> str:
    """``value`` if it is a valid conversation id, else a stable digest of it.

    Framework ids (session ids, thread ids) can hold characters a header or metrics label must
    not; the digest keeps the same framework id mapping to the same conversation.
    """
    if is_valid_conversation_id(value):
        return value
    return "h-" + hashlib.sha256(value.encode()).hexdigest()[:40]


def turn_headers(conversation_id: str, turn_id: str, pause: Pause | None) -> dict[str, str]:
    """Headers of one turn; the pause ones only when a pause preceded it."""
    headers = {CONVERSATION_ID: conversation_id, TURN_ID: turn_id}
    if pause is not None:
        headers[PAUSE_MS] = str(pause.ms)
        headers[PAUSE_KIND] = pause.kind
    return headers
