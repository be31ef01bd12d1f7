"""The wire between the gateway and the engines' kvturn connector, declared once.

Both sides import this module; neither spells a key, route or variable name of its own (a test
in ``tests/unit/test_layout.py`` holds them to it). Every value here is on the wire: changing
one breaks running engines and other gateways.

**kv_transfer_params.** Field names follow vLLM's NixlConnector (0.32/0.33); kvturn adds the
``*_KEY`` names below. The gateway names a decode request's conversation, lease and pause;
the decode-side connector publishes, with a retained turn's NIXL params, chained digests of the
token ids its blocks hold (:func:`prefix_digests`), the engine's block size and KV bytes per
token, how many of those tokens were the prompt, and the lease's time left. The prefill-side
connector checks the digests against the new prompt's exact ids: reuse is trimmed to the common
prefix, so an edited history never reuses stale KV.

**kv_connector_extra_config.** The ``*_CONFIG`` names the connector reads from the engine's
``--kv-transfer-config`` (``kvturn up`` and the Helm chart write them).

**The control channel.** A small HTTP server in each decode engine (and, in push mode, each
prefill engine), served by :mod:`kvturn.connector.control_server` and called by
:mod:`kvturn.gateway.leases`. Every route but :data:`HEALTH_PATH` needs
``authorization: Bearer <secret>`` when the engine has a secret (:data:`CONTROL_SECRET_ENV` in
its environment, which ``kvturn up`` generates and gives to the engines and the gateway alike);
anything else gets 401 and changes nothing. Routes (``{key}`` is the X-Request-Id the gateway
sent with the turn):

``GET /kvturn/retained/{key}?wait_ms=N``
    The live lease's params (what a prefill needs to read the blocks) and ``expires_in_s``,
    waiting up to N ms for the turn to finish; 404 :class:`LeaseGone` if there is none.
``POST /kvturn/leases/{key}/claim``
    A prefill is about to read the lease: it is held until the read ends. Answers the params,
    with ``remote_blocks_expiry_time`` brought up to the lease's current deadline; 404
    :class:`LeaseGone`.
``POST /kvturn/leases/{key}/renew``
    Body :class:`RenewRequest`: extend a live lease. Answers :class:`RenewResponse`, or 404
    :class:`LeaseGone`.
``DELETE /kvturn/leases/{key}[?claimed=1]``
    Free the blocks now (``claimed=1``: the caller's own claim is over, its read ended).
    Answers :class:`LeaseReleased`.
``POST /kvturn/wake``
    Body :class:`WakeRequest` (optional). A turn is on its way to this engine: stop pacing idle
    steps (see :class:`~kvturn.connector.engine_pacing.IdlePacer`). Every POST and DELETE also
    does this.
``GET /kvturn/identity``
    :class:`EngineIdentity`: the engine's NIXL identity. A push-mode gateway names the prefill
    to the decode that registers its blocks with it before prefill has answered.
``GET /kvturn/pushes/{key}?wait_ms=N``
    Push mode, decode: :class:`PushState` of the KV a prefill pushed for the request.
``GET /kvturn/leases``
    :class:`LeaseStats`: live leases, blocks they hold, events, the engine's facts.
``GET /kvturn/health``
    :class:`Acknowledged`.

Malformed calls get 400 and unknown routes 404, both as :class:`ControlError`. Bodies are sent
by field alias, without the fields that are ``None``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Final, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ---- kv_transfer_params -------------------------------------------------------------------------

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

#: Gateway → decode: the conversation the turn belongs to. ``None``: no turn will come back for
#: this KV, keep none. Absent: no kvturn gateway sent it (upstream's fixed-TTL semantics).
CONVERSATION_KEY: Final = "kvturn_conversation"
#: Gateway → decode: how long (seconds) to keep the turn's KV for the next one.
LEASE_KEY: Final = "kvturn_lease_s"
#: Gateway → decode: the pause the client reported before this turn, ``[kind, milliseconds]``.
PAUSE_KEY: Final = "kvturn_pause"
#: Decode → gateway → prefill: chained digests of the token ids the holder retains, one per
#: :data:`DIGEST_CHUNK_TOKENS` tokens.
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
#: Prefill → gateway: the prompt tokens prefill's own prefix cache served, apart from any it
#: pulled (usage's ``cached_tokens`` counts both): what a pull actually moved is the rest.
PREFILL_CACHED_KEY: Final = "kvturn_prefill_cached_tokens"
#: Decode → gateway: seconds left on the lease when it was published (or served). Its deadline
#: on the decode's own clock is vLLM's ``remote_blocks_expiry_time``.
EXPIRES_IN_KEY: Final = "expires_in_s"

#: Tokens covered by one prefix digest. Reuse is trimmed to a multiple of this.
DIGEST_CHUNK_TOKENS: Final = 16

# ---- kv_connector_extra_config ------------------------------------------------------------------

#: Port of the connector's control server (none: no control server, no leases).
CONTROL_PORT_CONFIG: Final = "kvturn_control_port"
#: Address the control server listens on (default loopback).
CONTROL_HOST_CONFIG: Final = "kvturn_control_host"
#: Whether a request no kvturn gateway sent keeps its KV for the fixed TTL (default true).
RETAIN_UNTRACKED_CONFIG: Final = "kvturn_retain_untracked"
#: Whether the control server may run without the shared secret, open to anyone who reaches
#: its port (default false: without :data:`CONTROL_SECRET_ENV` the engine refuses to start).
INSECURE_CONTROL_CONFIG: Final = "kvturn_insecure_control"
#: How long a lease may be held by a prefill's claim (seconds, default 30).
CLAIM_S_CONFIG: Final = "kvturn_claim_s"
#: Free KV blocks below this fraction of the cache reclaim leases (default 0.05).
FREE_BLOCKS_WATERMARK_CONFIG: Final = "kvturn_free_blocks_watermark"
#: NIXL progress thread's delay floor (µs; 0: NIXL's own; default on CPU only).
NIXL_PROGRESS_DELAY_US_CONFIG: Final = "kvturn_nixl_progress_delay_us"
#: Whether idle engine steps are paced (default on CPU only), and how long they sleep.
IDLE_PACING_CONFIG: Final = "kvturn_idle_pacing"
IDLE_STEP_SLEEP_MS_CONFIG: Final = "kvturn_idle_step_sleep_ms"
IDLE_LONG_SLEEP_MS_CONFIG: Final = "kvturn_idle_long_sleep_ms"
#: The worker's shared-memory spin window (ms; 0: upstream's; default 2 on CPU only).
WORKER_SPIN_MS_CONFIG: Final = "kvturn_worker_spin_ms"

# ---- the control channel: secret, routes --------------------------------------------------------

#: The environment variable that holds the control channel's shared secret (engines and
#: gateway alike).
CONTROL_SECRET_ENV: Final = "KVTURN_CONTROL_SECRET"
#: The header that carries it, as ``Bearer <secret>``.
CONTROL_AUTH_HEADER: Final = "authorization"
_BEARER: Final = "Bearer "

HEALTH_PATH: Final = "/kvturn/health"
LEASES_PATH: Final = "/kvturn/leases"
IDENTITY_PATH: Final = "/kvturn/identity"
WAKE_PATH: Final = "/kvturn/wake"
#: An engine about to stop (a Kubernetes ``preStop``) asks to take no new turns (``POST``;
#: ``DELETE`` calls it off): the gateways see it on :data:`HEALTH_PATH` and send its
#: conversations' next turns elsewhere, pulling their history from it while it still answers.
DRAIN_PATH: Final = "/kvturn/drain"
#: Routes that name a lease (or a push) by its key: templates, ``{key}`` the X-Request-Id.
RETAINED_ROUTE: Final = "/kvturn/retained/{key}"
LEASE_ROUTE: Final = LEASES_PATH + "/{key}"
CLAIM_ROUTE: Final = LEASE_ROUTE + "/claim"
RENEW_ROUTE: Final = LEASE_ROUTE + "/renew"
PUSHES_ROUTE: Final = "/kvturn/pushes/{key}"
#: Every route the control server serves (which methods: see the module's docstring).
CONTROL_ROUTES: Final = (
    HEALTH_PATH,
    LEASES_PATH,
    IDENTITY_PATH,
    WAKE_PATH,
    DRAIN_PATH,
    RETAINED_ROUTE,
    LEASE_ROUTE,
    CLAIM_ROUTE,
    RENEW_ROUTE,
    PUSHES_ROUTE,
)
#: Query parameters: how long to wait for a lease or push (ms); whether a release ends the
#: caller's own claim.
WAIT_MS_QUERY: Final = "wait_ms"
CLAIMED_QUERY: Final = "claimed"


def control_authorization(secret: str) -> str:
    """The :data:`CONTROL_AUTH_HEADER` value that carries ``secret``."""
    return f"{_BEARER}{secret}"


def presented_secret(authorization: str) -> str | None:
    """The secret an :data:`CONTROL_AUTH_HEADER` value carries (``None``: not a bearer one)."""
    return authorization[len(_BEARER) :] if authorization.startswith(_BEARER) else None


def _keyed(route: str, key: str) -> str:
    return route.replace("{key}", quote(key))


def retained_path(key: str, wait_s: float) -> str:
    """The lease a finished turn published under ``key``, waiting up to ``wait_s``."""
    return f"{_keyed(RETAINED_ROUTE, key)}?{WAIT_MS_QUERY}={int(wait_s * 1000)}"


def claim_path(key: str) -> str:
    return _keyed(CLAIM_ROUTE, key)


def renew_path(key: str) -> str:
    return _keyed(RENEW_ROUTE, key)


def lease_path(key: str, *, claimed: bool = False) -> str:
    """The lease to release (``claimed``: the caller's own claim is over)."""
    return _keyed(LEASE_ROUTE, key) + (f"?{CLAIMED_QUERY}=1" if claimed else "")


def pushes_path(key: str, wait_s: float) -> str:
    """Push mode: whether the KV pushed for ``key`` arrived, waiting up to ``wait_s``."""
    return f"{_keyed(PUSHES_ROUTE, key)}?{WAIT_MS_QUERY}={int(wait_s * 1000)}"


def match_control_route(target: str) -> tuple[str | None, str | None, dict[str, list[str]]]:
    """A request target's route (one of :data:`CONTROL_ROUTES`, ``None`` if none), the key it
    names (unquoted; ``None`` for a route without one) and its query."""
    url = urlsplit(target)
    query = parse_qs(url.query)
    parts = [unquote(p) for p in url.path.strip("/").split("/")]
    for route in CONTROL_ROUTES:
        pattern = route.strip("/").split("/")
        if len(pattern) == len(parts) and all(
            p == "{key}" or p == given for p, given in zip(pattern, parts, strict=True)
        ):
            key = parts[pattern.index("{key}")] if "{key}" in pattern else None
            return route, key, query
    return None, None, query


def claimed_flag(query: dict[str, list[str]]) -> bool:
    """Whether a release's query says the caller's claim is over."""
    return query.get(CLAIMED_QUERY, ["0"])[0] in ("1", "true")


# ---- the control channel: bodies ---------------------------------------------------------------

#: Why a lease ended.
EndReason = Literal["read", "expired", "released", "reclaimed", "superseded"]
#: A push's KV for a request: arrived, registered and not yet written, or not known.
PushStateName = Literal["arrived", "awaiting", "unknown"]
#: How an engine's connector moves KV: prefill's pulled by decode, or pushed by prefill.
TransferMode = Literal["pull", "push"]


class Acknowledged(BaseModel):
    """Health, a wake and a drain: yes, and whether the engine is draining (it takes no new
    turns: :data:`DRAIN_PATH`)."""

    ok: bool = True
    draining: bool = False


class ControlError(BaseModel):
    """A refused call (400, 401, 404)."""

    error: str


class LeaseGone(BaseModel):
    """404 from a route that names a lease: there is no live one under the key, and why."""

    error: str = "no live lease"
    #: An :data:`EndReason`, or ``unknown``.
    reason: str | None = None


class RenewRequest(BaseModel):
    """Extend a live lease to ``lease_s`` from now (never shorten it) and say what kind of pause
    the conversation is in, and for how long it has lasted."""

    lease_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: ``tool``, ``user`` or ``unknown``; anything else leaves the lease's kind as it is.
    pause_kind: str | None = None
    paused_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("pause_kind", mode="before")
    @classmethod
    def _only_strings(cls, value: object) -> object:
        return value if isinstance(value, str) else None


class RenewResponse(BaseModel):
    """Seconds left on the renewed lease."""

    expires_in_s: float


class LeaseReleased(BaseModel):
    """Whether there was a lease to release."""

    released: bool


class WakeRequest(BaseModel):
    """The request itself arrives within ``within_ms`` (at most a second is honoured); not a
    number: no promise."""

    within_ms: float | None = None

    @field_validator("within_ms", mode="before")
    @classmethod
    def _only_numbers(cls, value: object) -> object:
        return value if isinstance(value, (int, float)) else None


class EngineIdentity(BaseModel):
    """What a peer needs to reach an engine over NIXL before any request has told it."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int = 1
    pp_size: int = 1
    transfer_mode: TransferMode = "pull"


class PushState(BaseModel):
    state: PushStateName


class LeaseStats(BaseModel):
    """A decode's lease counts, and the facts about the engine the gateway needs (present once
    the connector knows them)."""

    model_config = ConfigDict(populate_by_name=True)

    #: Live leases (not ended, not lapsed).
    leases: int
    #: Blocks every lease not yet freed holds.
    blocks_held: int
    retained: int
    not_retained: int
    renewed: int
    claimed: int
    #: Leases ended, by :data:`EndReason`.
    ended: dict[str, int]
    block_size: int | None = Field(default=None, alias=BLOCK_SIZE_KEY)
    kv_bytes_per_token: int | None = Field(default=None, alias=KV_BYTES_PER_TOKEN_KEY)
    max_lease_s: float | None = Field(default=None, alias=MAX_LEASE_KEY)


# ---- prefix digests -----------------------------------------------------------------------------


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
