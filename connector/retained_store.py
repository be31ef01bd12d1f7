"""What a decode instance retained, per request, for the gateway to look up (plain Python).

vLLM 0.32 returns ``kv_transfer_params`` only in non-streamed responses, so the decode-side
connector also publishes them here, keyed by request id. Entries leave when their blocks expire,
and the store is bounded, so a forgotten conversation never grows memory.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# vLLM appends "-<8 hex>" to every request id, and prefixes chat ids with "chatcmpl-" and
# completion ids with "cmpl-"; a completion's id also carries its prompt's position ("-0").
# The gateway knows only the X-Request-Id it sent.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
_CHAT_PREFIX = "chatcmpl-"
_COMPLETION = re.compile(r"^cmpl-(.*)-\d+$")


def publication_key(engine_request_id: str) -> str:
    """The X-Request-Id part of an engine request id."""
    request_id = _RANDOM_SUFFIX.sub("", engine_request_id)
    completion = _COMPLETION.match(request_id)
    if completion is not None:
        return completion.group(1)
    return request_id.removeprefix(_CHAT_PREFIX)


class RetainedStore:
    """Thread-safe, bounded map from request id to the retained-KV params, with expiry."""

    def __init__(self, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic):
        self._entries: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Condition()

    def publish(self, request_id: str, params: dict[str, Any], ttl_s: float) -> None:
        """Record ``params`` for ``request_id`` until ``ttl_s`` seconds from now."""
        key = publication_key(request_id)
        with self._lock:
            self._entries[key] = (self._clock() + ttl_s, params)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            self._lock.notify_all()

    def get(self, key: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The live params published under ``key`` (the X-Request-Id the gateway sent, taken
        as it is: it may itself end like vLLM's suffix), waiting up to ``wait_s`` for them.

        The returned dict carries ``expires_in_s``: the time left on this store's clock.
        """
        deadline = self._clock() + wait_s
        with self._lock:
            while True:
                self._drop_expired()
                entry = self._entries.get(key)
                if entry is not None:
                    expiry, params = entry
                    return {**params, "expires_in_s": round(expiry - self._clock(), 3)}
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)

    def discard(self, request_id: str) -> bool:
        """Forget the engine request ``request_id``; whether it was there."""
        with self._lock:
            return self._entries.pop(publication_key(request_id), None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._entries)

    def _drop_expired(self) -> None:
        now = self._clock()
        for key in [k for k, (expiry, _) in self._entries.items() if expiry <= now]:
            del self._entries[key]
