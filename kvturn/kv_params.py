"""The ``kv_transfer_params`` that travel between the gateway and the engines.

Field names follow vLLM's NixlConnector (0.32/0.33). kvturn adds two keys of its own:

``kvturn_prefix_digests``
    Chained digests of the token ids that the holder decode retains, one per
    :data:`DIGEST_CHUNK_TOKENS` tokens. Published by the decode-side connector, forwarded by the
    gateway, checked by the prefill-side connector against the new prompt's exact ids: reuse is
    trimmed to the common prefix, so an edited history never reuses stale KV.
``kvturn_request_id``
    The id under which the decode-side connector published the retained blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

#: What a proxy sends to prefill for plain P/D: compute the prompt, keep its KV for decode to
#: pull (vLLM's NixlConnector protocol). Copy it before changing it.
PREFILL_FOR_REMOTE_DECODE: Final[dict[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Tokens covered by one prefix digest. Reuse is trimmed to a multiple of this.
DIGEST_CHUNK_TOKENS: Final = 16
PREFIX_DIGESTS_KEY: Final = "kvturn_prefix_digests"
#: The holder's KV block size (tokens): its prefix cache serves whole blocks only.
BLOCK_SIZE_KEY: Final = "kvturn_block_size"
#: Bytes one token's KV occupies on the holder (all layers), for "KV bytes moved".
KV_BYTES_PER_TOKEN_KEY: Final = "kvturn_kv_bytes_per_token"
#: The longest lease the decode grants (seconds, its ``decoder_kv_blocks_ttl``): a lease asked
#: for longer is cut to it, so the gateway promises a client no more.
MAX_LEASE_KEY: Final = "kvturn_max_lease_s"
#: How many of the retained tokens were the turn's prompt (the rest, its reply): the prefix the
#: next turn's prompt starts with, unedited.
PROMPT_TOKENS_KEY: Final = "kvturn_prompt_tokens"


def prefix_digests(token_ids: Sequence[int], chunk: int = DIGEST_CHUNK_TOKENS) -> list[str]:
    """Chained digests of every full ``chunk`` of ``token_ids``.

    Digest ``i`` commits to tokens ``[0, (i + 1) * chunk)``, so two sequences share their first
    ``k`` digests exactly when their first ``k * chunk`` tokens are equal.
    """
    return [d.hex() for d in _chain(token_ids, len(token_ids) // chunk, chunk)]


def last_prefix_digest(
    token_ids: Sequence[int], tokens: int, chunk: int = DIGEST_CHUNK_TOKENS
) -> str | None:
    """``prefix_digests(token_ids[:tokens])[-1]`` (``None`` if ``token_ids`` is shorter than
    ``tokens`` or ``tokens`` covers no full chunk): whether a prompt starts with what a holder
    retains, checked against the one digest the gateway keeps."""
    if tokens < chunk or len(token_ids) < tokens:
        return None
    digests = _chain(token_ids, tokens // chunk, chunk)
    return digests[-1].hex()


def _chain(token_ids: Sequence[int], chunks: int, chunk: int) -> list[bytes]:
    # Token ids as little-endian uint32, packed once (ids are below 2**32 in every vocabulary).
    packed = struct.pack(f"<{chunks * chunk}I", *token_ids[: chunks * chunk])
    step = 4 * chunk
    digests: list[bytes] = []
    previous = b""
    for start in range(0, chunks * step, step):
        h = hashlib.blake2b(previous, digest_size=12)
        h.update(packed[start : start + step])
        previous = h.digest()
        digests.append(previous)
    return digests


def common_prefix_tokens(
    expected: Sequence[str], token_ids: Sequence[int], chunk: int = DIGEST_CHUNK_TOKENS
) -> int:
    """How many leading ``token_ids`` match the sequence that ``expected`` digests describe."""
    ours = prefix_digests(token_ids[: len(expected) * chunk], chunk)
    matched = 0
    for a, b in zip(expected, ours, strict=False):
        if a != b:
            break
        matched += 1
    return matched * chunk


class RetainedKV(BaseModel):
    """What a decode instance retained after a turn: where the KV is and what it holds.

    Metadata only. ``remote_blocks_expiry_time`` is on the decode process's ``perf_counter``
    clock; ``expires_in_s`` is the same deadline relative to when it was published.
    """

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[list[int]]
    remote_host: str
    remote_port: int
    remote_num_tokens: int
    tp_size: int = 1
    remote_blocks_expiry_time: float | None = None
    expires_in_s: float | None = None
    kvturn_prefix_digests: list[str] = []

    def as_prefill_params(self, host: str | None = None) -> dict[str, Any]:
        """The params to send to a prefill engine that should pull this KV."""
        params = self.model_dump(exclude={"expires_in_s"})
        if host is not None:
            params["remote_host"] = host
        return params
